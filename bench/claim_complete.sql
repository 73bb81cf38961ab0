-- The raw claim (the seed's UPDATE over a FOR UPDATE SKIP LOCKED subquery) of :batch jobs,
-- then their guarded completion in one UPDATE: two transactions, like a worker's claim + settle.
-- `NOT scheduled` and `limit_key IS NULL` are part of the claim index's predicate (migrations
-- 0012 and 0015): without them the claim cannot use that index, and each one read and sorted
-- the whole table (the ceilings measured from 0008 until `NOT scheduled` was added were that
-- plan's).
WITH claimed AS (
    UPDATE pgjobs_job AS j
    SET status = 'running', attempts = j.attempts + 1, worker = 'pgbench-' || :client_id,
        leased_until = statement_timestamp() + interval '30 seconds'
    WHERE j.id IN (
        SELECT id FROM pgjobs_job
        WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = 'default'
          AND run_at <= statement_timestamp()
        ORDER BY priority DESC, run_at, id
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    RETURNING j.id, j.attempts
)
SELECT array_agg(id) AS ids, array_agg(attempts) AS attempts FROM claimed \gset
UPDATE pgjobs_job AS j
SET status = 'succeeded', finished_at = statement_timestamp(), leased_until = NULL
FROM unnest(:ids::uuid[], :attempts::int4[]) AS mine(id, attempts)
WHERE j.id = mine.id AND j.attempts = mine.attempts
  AND j.status = 'running' AND j.worker = 'pgbench-' || :client_id;
