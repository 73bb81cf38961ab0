-- One job per transaction, time-ordered id (like uuid7): the single-enqueue ceiling.
INSERT INTO pgjobs_job (id, queue, task, payload, priority, run_at, max_attempts)
VALUES (lpad(to_hex(nextval('bench_ids')), 32, '0')::uuid, 'default', 'bench.tasks.noop',
        '{}', 0, statement_timestamp(), 5);
