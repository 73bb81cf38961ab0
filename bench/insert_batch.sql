-- :rows jobs per INSERT statement: the bulk-enqueue ceiling.
INSERT INTO pgjobs_job (id, queue, task, payload, priority, run_at, max_attempts)
SELECT lpad(to_hex(nextval('bench_ids')), 32, '0')::uuid, 'default', 'bench.tasks.noop',
       '{}', 0, statement_timestamp(), 5
FROM generate_series(1, :rows);
