-- One job per explicit transaction, as `with atomic(): enqueue(...)` runs it: BEGIN, the
-- INSERT and COMMIT are three round trips (psycopg sends BEGIN on its own, like pgbench).
BEGIN;
INSERT INTO pgjobs_job (id, queue, task, payload, priority, run_at, max_attempts)
VALUES (lpad(to_hex(nextval('bench_ids')), 32, '0')::uuid, 'default', 'bench.tasks.noop',
        '{}', 0, statement_timestamp(), 5);
COMMIT;
