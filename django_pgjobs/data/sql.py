"""Every statement that changes a job, as one complete SQL text with named parameters.

A statement is chosen whole (e.g. with or without ON CONFLICT), never assembled from pieces, so
what runs is what you read here. Times are the database's clock (``statement_timestamp()``),
never the app's.

Guarded statements change a job only while it is ``running`` under the same claim, identified
by (id, claims, worker). `claims` counts every claim of the job and is never reset, not even by
a replay: a fencing token no later claim reuses, so a worker whose lease expired cannot
overwrite the attempt that replaced it.

Those that find a worker's jobs by id spell the status guard ``(j.status = 'running') IS TRUE``,
which the planner cannot match to the running jobs' partial index: the rows are looked up by
primary key, not through an index full of dead row versions a long snapshot keeps.

A worker plans each statement once for any parameters (data/rows.py), so every plan must be
good without their values: rows a LIMITed subquery chose are found by primary key,
``j.id = ANY (ARRAY(SELECT ...))``, never joined, which a generic plan would hash-join whole.
"""

from __future__ import annotations

#: The job table's columns in the model's field order: every statement that returns whole jobs
#: returns them in this order (data/rows.py loads them; a test checks it against the model).
JOB_COLUMNS = (
    "id", "queue", "task", "payload", "status", "priority", "run_at", "attempts", "max_attempts",
    "leased_until", "worker", "last_error", "errors", "created_at", "finished_at", "unique_key",
    "started_at", "cancel_requested", "result", "claims", "scheduled", "progress", "headers",
    "limit_key", "batch_id",
)  # fmt: skip

#: The claim's ORDER BY within one queue, and the claim index's columns after `queue`.
#: One constant for the index (models.Job.Meta) and the claim below: change both together.
CLAIM_ORDER = ("-priority", "run_at", "id")

# ---- enqueue -------------------------------------------------------------------------------------

# One job: INSERT_JOBS[due, unique, wake_up] is the statement for the case at hand, so that
# each text says only what that case needs: an enqueue is usually parsed and planned each time
# (not prepared), and a text for every case costs more to plan.
#
# - due: "now" (most jobs), "run_at" (given) or "delay" (seconds from now), always on the
#   database's clock; a job not yet due is `scheduled` (it waits in the scheduled index, out of
#   the claims' way).
# - unique: nothing is inserted (no row comes back) while a ready or running job holds the
#   unique_key. Apart, because a speculative insertion costs more CPU and WAL than a plain one,
#   and most jobs have no key.
# - wake_up: a NOTIFY delivered at commit (data/wakeups.py sends, runtime/postgres.py listens)
#   rides in the same statement, evaluated only for an inserted row.
# %(headers)s is NULL unless PGJOBS["TRACING"] gives the job a trace context (tracing.py).
_DUE = {
    "now": "statement_timestamp(), false",
    "run_at": "%(run_at)s::timestamptz, %(run_at)s::timestamptz > statement_timestamp()",
    "delay": "statement_timestamp() + %(delay)s::float8 * interval '1 second', "
    "%(delay)s::float8 * interval '1 second' > interval '0'",
}
_UNIQUE = """
    ON CONFLICT (unique_key) WHERE status IN ('ready', 'running') AND unique_key IS NOT NULL
    DO NOTHING"""
_WAKE_UP = ", pg_notify(%(channel)s, %(queue)s)"
_INSERT_JOB = """
    INSERT INTO pgjobs_job AS j
        (id, queue, task, payload, status, priority, run_at, scheduled, max_attempts,
         unique_key, headers, limit_key, batch_id)
    VALUES (
        %(id)s, %(queue)s, %(task)s, %(payload)s::jsonb, %(status)s, %(priority)s, {due},
        %(max_attempts)s, %(unique_key)s, %(headers)s::jsonb, %(limit_key)s, %(batch)s
    ){unique}
    RETURNING j.id, j.run_at, j.created_at, j.scheduled{wake_up}
"""
INSERT_JOBS = {
    (due, unique, wake_up): _INSERT_JOB.format(
        due=values, unique=_UNIQUE if unique else "", wake_up=_WAKE_UP if wake_up else ""
    )
    for due, values in _DUE.items()
    for unique in (False, True)
    for wake_up in (False, True)
}

# Many jobs of one task with the same options (never a unique_key) are written by binary COPY
# (data/rows.py copy). COPY has no RETURNING, so what the database decides comes first, from
# this statement in the same transaction: the created_at and run_at the rows share (the
# database's clock) and whether they are scheduled; it also sends the wake-up (%(channel)s
# NULL when none is due), delivered with the rows at commit.
NEW_JOBS_TIMES = """
    SELECT statement_timestamp(), t.run_at, t.run_at > statement_timestamp(),
           (SELECT pg_notify(%(channel)s, %(queue)s) WHERE %(channel)s IS NOT NULL)
    FROM (SELECT COALESCE(%(run_at)s::timestamptz,
                          statement_timestamp() + %(delay)s::float8 * interval '1 second'))
         AS t(run_at)
"""

# Every other column takes its default, as for INSERT_JOBS. The binary format sends each value
# as its column's type: COPY_JOBS_TYPES, in the order of COPY_JOBS's columns.
COPY_JOBS = """
    COPY pgjobs_job (id, queue, task, payload, priority, run_at, scheduled, max_attempts,
                     created_at, headers, limit_key, batch_id)
    FROM STDIN (FORMAT BINARY)
"""
COPY_JOBS_TYPES = (
    "uuid", "text", "text", "jsonb", "int2", "timestamptz", "bool", "int4", "timestamptz", "jsonb",
    "text", "uuid",
)  # fmt: skip

# ---- one turn of a worker: settle, then claim -------------------------------------------

# A worker's turn in one statement (one round trip, one commit): record the outcomes of its
# finished jobs and claim due jobs into the slots they free. An empty array (or a %(limit)s of
# 0) makes its part a no-op; CLAIM, below, is the claim alone, for a turn with no outcome.
#
# - succeeded: completions, guarded on the claim, keeping each handler's return value (JSON
#   text, or NULL to keep nothing) and, as failed does, its last progress report (as HEARTBEAT).
# - failed: each failed attempt is cancelled (if a cancellation was requested), back to ready
#   after its delay (attempts left and not permanent), or failed: the dead letter. Its error
#   joins the job's history, of which the last %(errors_kept)s entries are kept.
# - due: per queue, a range scan of the claim index in its own order that stops after its
#   room (%(rooms)s: %(limit)s, or fewer for a queue that yields, runtime/controls.py) rows;
#   SKIP LOCKED, so concurrent workers never wait for each other or take the
#   same job (one scan ordered across queues would read and sort every ready row).
#   A queue's scan starts after the position its worker's claims got to (%(after_*)s: the
#   priority, run_at and id of the last job it claimed there), not at the index's start, which
#   holds an entry for every job claimed since the last vacuum (many, under a long snapshot).
#   In claim order: jobs of a higher priority than the position, then those after it at its
#   priority, then lower priorities; each branch runs only while those before it found fewer
#   than its room. A NULL position is the whole range. Jobs that become ready behind a
#   position are found by the worker's next sweep from the start (runtime/postgres.py).
#   Scheduled jobs are not in the claim index, so the scan never walks past waiting jobs;
#   those come due are found by run_at in the scheduled index (few: see PROMOTE).
# - turns: the queues take turns (each queue's best job, then each queue's second best, ...;
#   ties in claim order), so an old backlog in one queue never starves another.
# - claimed: running, leased for %(lease)s seconds, attempts counting this one, and the claim
#   counted (its fencing token); the progress a previous attempt reported is cleared.
#
# Rows come back tagged by kind in one shape: claimed jobs with every column (JOB_COLUMNS
# order), settled jobs with their id, claim and new status, the other columns NULL.
# _ENDS: a failed attempt ends its job (cancelled, a permanent error, or no attempt left).
_ENDS = "(j.cancel_requested OR f.permanent OR j.attempts >= j.max_attempts)"

# Whether a job ended is followed up (batches.py): its batch, and whether a job waits for it,
# looked for only while some job waits or may be released again (a probe each, once a
# statement), so that a queue without dependencies pays for none.
_WAITED = """CASE WHEN (SELECT EXISTS (SELECT FROM pgjobs_job WHERE status = 'waiting')
                           OR EXISTS (SELECT FROM pgjobs_dependency WHERE failed))
                 THEN EXISTS (SELECT FROM pgjobs_dependency AS d WHERE d.after_job_id = j.id)
                 ELSE false END AS waited"""

_SETTLE = f"""
    succeeded AS (
        UPDATE pgjobs_job AS j
        SET status = 'succeeded', finished_at = statement_timestamp(), leased_until = NULL,
            result = mine.result,
            progress = CASE WHEN mine.progress IS NULL
                              OR mine.progress = CASE WHEN jsonb_typeof(j.progress) = 'object'
                                                   THEN j.progress - 'at' END
                            THEN j.progress
                            ELSE mine.progress || jsonb_build_object('at', statement_timestamp())
                       END
        FROM unnest(%(succeeded_ids)s::uuid[], %(succeeded_claims)s::int4[],
                    %(results)s::text[]::jsonb[], %(succeeded_progress)s::text[]::jsonb[])
             AS mine(id, claims, result, progress)
        WHERE j.id = mine.id AND j.claims = mine.claims
          AND (j.status = 'running') IS TRUE AND j.worker = %(worker)s
        RETURNING j.id, j.claims, j.status, j.batch_id, {_WAITED}
    ),
    failed AS (
        UPDATE pgjobs_job AS j SET
            status = CASE WHEN j.cancel_requested THEN 'cancelled'
                          WHEN {_ENDS} THEN 'failed' ELSE 'ready' END,
            finished_at = CASE WHEN {_ENDS} THEN statement_timestamp() END,
            run_at = CASE WHEN {_ENDS} THEN j.run_at
                          ELSE statement_timestamp() + make_interval(secs => f.delay) END,
            scheduled = NOT {_ENDS} AND f.delay > 0,
            leased_until = NULL,
            progress = CASE WHEN f.progress IS NULL
                              OR f.progress = CASE WHEN jsonb_typeof(j.progress) = 'object'
                                                THEN j.progress - 'at' END
                            THEN j.progress
                            ELSE f.progress || jsonb_build_object('at', statement_timestamp())
                       END,
            last_error = f.summary,
            errors = jsonb_path_query_array(
                j.errors || jsonb_build_array(
                    jsonb_build_object(
                        'attempt', j.attempts, 'at', statement_timestamp(), 'worker', j.worker
                    ) || f.error::jsonb
                ),
                %(errors_kept)s::jsonpath
            )
        FROM unnest(%(failed_ids)s::uuid[], %(failed_claims)s::int4[], %(permanent)s::bool[],
                    %(delays)s::float8[], %(summaries)s::text[], %(errors)s::text[],
                    %(failed_progress)s::text[]::jsonb[])
             AS f(id, claims, permanent, delay, summary, error, progress)
        WHERE j.id = f.id AND j.claims = f.claims
          AND (j.status = 'running') IS TRUE AND j.worker = %(worker)s
        RETURNING j.id, j.claims, j.status, j.batch_id, {_WAITED}
    ),
"""

# A claimed job's columns (JOB_COLUMNS), with run_at clamped to the years Python can hold (an
# operator may set '-infinity' by hand): a row the worker cannot read fails a committed claim.
_CLAIMED = """
    j.id, j.queue, j.task, j.payload, j.status, j.priority,
    LEAST(GREATEST(j.run_at, '0001-01-02 00:00:00+00'), '9999-12-30 00:00:00+00') AS run_at,
    j.attempts, j.max_attempts, j.leased_until, j.worker, j.last_error, j.errors, j.created_at,
    j.finished_at, j.unique_key, j.started_at, j.cancel_requested, j.result, j.claims,
    j.scheduled, j.progress, j.headers, j.limit_key, j.batch_id
"""

# The claim of the jobs `turns` chose (`claimed`, above); CLAIM_KEYED's too.
_TAKE_TURNS = f"""claimed AS (
        UPDATE pgjobs_job AS j
        SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1,
            worker = %(worker)s, scheduled = false, progress = NULL,
            started_at = statement_timestamp(),
            leased_until = statement_timestamp() + make_interval(secs => %(lease)s)
        WHERE j.id = ANY (ARRAY(SELECT id FROM turns))
        RETURNING {_CLAIMED}
    )"""

_CLAIM = f"""
    due AS (
        SELECT d.id, d.priority, d.run_at, q.turn_of
        FROM unnest(%(queues)s::text[], %(rooms)s::int4[], %(after_priority)s::int2[],
                    %(after_run_at)s::timestamptz[], %(after_id)s::uuid[])
             WITH ORDINALITY AS q(name, room, priority, run_at, id, turn_of)
        CROSS JOIN LATERAL (
            SELECT * FROM (
                SELECT id, priority, run_at FROM pgjobs_job
                WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = q.name
                  AND run_at <= statement_timestamp() AND priority > q.priority
                ORDER BY priority DESC, run_at, id
                LIMIT q.room
                FOR UPDATE SKIP LOCKED
            ) AS higher_priorities
            UNION ALL
            SELECT * FROM (
                SELECT id, priority, run_at FROM pgjobs_job
                WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = q.name
                  AND run_at <= statement_timestamp() AND priority = q.priority
                  AND (run_at, id) > (q.run_at, q.id)
                ORDER BY run_at, id
                LIMIT q.room
                FOR UPDATE SKIP LOCKED
            ) AS following
            UNION ALL
            SELECT * FROM (
                SELECT id, priority, run_at FROM pgjobs_job
                WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = q.name
                  AND run_at <= statement_timestamp()
                  AND priority < COALESCE(q.priority, 32767)
                ORDER BY priority DESC, run_at, id
                LIMIT q.room
                FOR UPDATE SKIP LOCKED
            ) AS lower_priorities
            LIMIT q.room
        ) AS d
        UNION ALL
        SELECT s.id, s.priority, s.run_at, q.turn_of
        FROM unnest(%(queues)s::text[], %(rooms)s::int4[])
             WITH ORDINALITY AS q(name, room, turn_of)
        CROSS JOIN LATERAL (
            SELECT id, priority, run_at FROM pgjobs_job
            WHERE status = 'ready' AND scheduled AND limit_key IS NULL AND queue = q.name
              AND run_at <= statement_timestamp()
            ORDER BY run_at, id
            LIMIT q.room
            FOR UPDATE SKIP LOCKED
        ) AS s
    ),
    turns AS (
        SELECT id FROM due
        ORDER BY row_number() OVER (PARTITION BY turn_of ORDER BY priority DESC, run_at, id),
                 priority DESC, run_at, id
        LIMIT %(limit)s
    ),
    {_TAKE_TURNS}
"""

SETTLE_AND_CLAIM = f"""
    WITH {_SETTLE.strip()}
    {_CLAIM.strip()}
    SELECT 'claimed' AS kind, *, NULL::bool AS waited FROM claimed
    UNION ALL
    SELECT 'settled', id, NULL, NULL, NULL, status, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, claims, NULL, NULL, NULL, NULL, batch_id,
           waited
    FROM (SELECT * FROM succeeded UNION ALL SELECT * FROM failed) AS settled
"""

# A turn with no outcome to record: the claim alone. Its plan has none of the settling
# statements' parts to start, which an idle worker's wake-up would pay for on a cold backend.
CLAIM = f"""
    WITH {_CLAIM.strip()}
    SELECT 'claimed' AS kind, *, NULL::bool AS waited FROM claimed
"""

# ---- a worker's own running jobs ----------------------------------------------------------

# Extend the leases of a worker's jobs by %(lease)s seconds from now, and record the progress
# each handler last reported (JSON text without "at", or NULL: none). Touches only unindexed
# columns, so the update can be HOT. A report equal to the stored one keeps its "at" (since
# when the job has been there); the jsonb_typeof test keeps a stored non-object, on which `-`
# raises, from failing the whole statement. A row locked elsewhere is skipped, not waited for:
# the others' leases must not run out behind it. Returns each renewed job's cancel_requested.
HEARTBEAT = """
    WITH renewable AS (
        SELECT j.id, mine.progress FROM pgjobs_job AS j
        JOIN unnest(%(ids)s::uuid[], %(claims)s::int4[], %(progress)s::text[]::jsonb[])
             AS mine(id, claims, progress)
          ON j.id = mine.id AND j.claims = mine.claims
        WHERE (j.status = 'running') IS TRUE AND j.worker = %(worker)s
        FOR NO KEY UPDATE OF j SKIP LOCKED
    )
    UPDATE pgjobs_job AS j
    SET leased_until = statement_timestamp() + make_interval(secs => %(lease)s),
        progress = CASE WHEN mine.progress IS NULL
                          OR mine.progress = CASE WHEN jsonb_typeof(j.progress) = 'object'
                                               THEN j.progress - 'at' END
                        THEN j.progress
                        ELSE mine.progress || jsonb_build_object('at', statement_timestamp())
                   END
    FROM renewable AS mine
    WHERE j.id = mine.id
    RETURNING j.id, j.cancel_requested
"""

# Which of a worker's claims it still holds (a plain read: no lock, no wait), in the shape of
# HEARTBEAT's result.
OWNED = """
    SELECT j.id, j.cancel_requested FROM pgjobs_job AS j
    JOIN unnest(%(ids)s::uuid[], %(claims)s::int4[]) AS mine(id, claims)
      ON j.id = mine.id AND j.claims = mine.claims
    WHERE (j.status = 'running') IS TRUE AND j.worker = %(worker)s
"""

# Which of a worker's claims another session holds locked: the rows its outcomes' UPDATE would
# wait for. Each row is only tried (SKIP LOCKED), outside a transaction.
LOCKED_ELSEWHERE = """
    WITH free AS (
        SELECT id FROM pgjobs_job WHERE id = ANY(%(ids)s::uuid[])
        FOR NO KEY UPDATE SKIP LOCKED
    )
    SELECT j.id FROM pgjobs_job AS j
    WHERE j.id = ANY(%(ids)s::uuid[]) AND j.id NOT IN (SELECT id FROM free)
"""

# Back to ready without spending an attempt (cancelled if that was asked): a worker shutting
# down (%(delay)s NULL: the job keeps its place), or a handler's Retry (due in %(delay)s
# seconds). Keeps each handler's last progress report, as SETTLE_AND_CLAIM does.
RELEASE = """
    UPDATE pgjobs_job AS j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'ready' END,
        finished_at = CASE WHEN j.cancel_requested THEN statement_timestamp() END,
        leased_until = NULL,
        attempts = j.attempts - 1,
        run_at = CASE WHEN j.cancel_requested OR %(delay)s::float8 IS NULL THEN j.run_at
                      ELSE statement_timestamp() + make_interval(secs => %(delay)s) END,
        scheduled = NOT j.cancel_requested AND COALESCE(%(delay)s::float8, 0) > 0,
        progress = CASE WHEN mine.progress IS NULL
                          OR mine.progress = CASE WHEN jsonb_typeof(j.progress) = 'object'
                                               THEN j.progress - 'at' END
                        THEN j.progress
                        ELSE mine.progress || jsonb_build_object('at', statement_timestamp())
                   END
    FROM unnest(%(ids)s::uuid[], %(claims)s::int4[], %(progress)s::text[]::jsonb[])
         AS mine(id, claims, progress)
    WHERE j.id = mine.id AND j.claims = mine.claims
      AND (j.status = 'running') IS TRUE AND j.worker = %(worker)s
    RETURNING j.id, j.cancel_requested
"""

# ---- every worker's housekeeping --------------------------------------------------------------

# What REAP and ABANDON do to a running job taken back: ready again after the default backoff
# (full jitter; REAP_BACKOFF then applies a task's own), failed when no attempts remain, or
# cancelled when that was asked; the lost attempt joins the error history (%(error)s).
_LOST_ENDS = "(j.cancel_requested OR j.attempts >= j.max_attempts)"  # as _ENDS, for a lost attempt
_TAKEN_BACK = f"""
        status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN {_LOST_ENDS} THEN 'failed' ELSE 'ready' END,
        finished_at = CASE WHEN {_LOST_ENDS} THEN statement_timestamp() END,
        run_at = statement_timestamp() + make_interval(
            secs => random() * least(%(cap)s, %(base)s * 2 ^ least(j.attempts - 1, 62))),
        scheduled = NOT {_LOST_ENDS},
        leased_until = NULL,
        errors = jsonb_path_query_array(
            j.errors || jsonb_build_array(
                jsonb_build_object(
                    'attempt', j.attempts, 'at', statement_timestamp(), 'worker', j.worker
                ) || %(error)s::jsonb
            ),
            %(errors_kept)s::jsonpath
        )
""".strip()

# Take back running jobs whose lease expired (_TAKEN_BACK). SKIP LOCKED: every worker may reap
# at once. A worker spares its own claims whose handlers are running (%(spared_*)s): a lease
# that ran out while its row was locked is renewed once the lock is gone.
REAP = f"""
    WITH expired AS (
        SELECT id FROM pgjobs_job
        WHERE status = 'running' AND leased_until < statement_timestamp()
          AND (id, claims) NOT IN (SELECT * FROM unnest(%(spared_ids)s::uuid[],
                                                        %(spared_claims)s::int4[]))
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    UPDATE pgjobs_job AS j SET
        {_TAKEN_BACK},
        last_error = 'WorkerLost: lease expired while held by ' || j.worker
    FROM expired
    WHERE j.id = expired.id AND j.status = 'running'
      AND j.leased_until < statement_timestamp()
    RETURNING j.id, j.claims, j.status, j.task, j.attempts
"""

# Jobs taken back (REAP, ABANDON) of tasks with a `backoff=` of their own: due after it instead
# of the default, while nobody claimed them since.
REAP_BACKOFF = """
    UPDATE pgjobs_job AS j SET
        run_at = statement_timestamp() + make_interval(secs => mine.delay),
        scheduled = mine.delay > 0
    FROM unnest(%(ids)s::uuid[], %(claims)s::int4[], %(delays)s::float8[])
         AS mine(id, claims, delay)
    WHERE j.id = mine.id AND j.claims = mine.claims AND j.status = 'ready'
    RETURNING j.id
"""

# Scheduled jobs come due join the claim index, oldest first, in bounded batches, so that claims
# see them in priority order. SKIP LOCKED: every worker may do it at once.
PROMOTE = """
    UPDATE pgjobs_job AS j SET scheduled = false
    WHERE j.id = ANY (ARRAY(
        SELECT id FROM pgjobs_job
        WHERE status = 'ready' AND scheduled AND run_at <= statement_timestamp()
        ORDER BY run_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ))
"""

# Take back every running job of one worker known to be dead (its supervisor saw the process
# exit), without waiting for the leases: as REAP, with the cause.
ABANDON = f"""
    UPDATE pgjobs_job AS j SET
        {_TAKEN_BACK},
        last_error = 'WorkerLost: ' || %(reason)s
    FROM (
        SELECT id FROM pgjobs_job
        WHERE status = 'running' AND worker = %(worker)s
        FOR UPDATE SKIP LOCKED
    ) AS dead
    WHERE j.id = dead.id AND j.status = 'running' AND j.worker = %(worker)s
    RETURNING j.id, j.claims, j.status, j.task, j.attempts
"""

# ---- queues with controls ---------------------------------------------------------------------

# Claims on a queue with a Queue row take turns: the row is locked first, so the count of
# running jobs that follows (a fresh snapshot) sees every claim committed before it. A row
# locked elsewhere is never waited for: its holder may be a stopped worker or an open
# transaction. BRIEF_LOCK_TIMEOUT bounds the controls' reads and a limited queue's claim on a
# locked table: past it the queue sits the turn out, rather than stall every queue's claims.
BRIEF_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', '100ms', true)"
LOCK_QUEUE = """
    SELECT paused, max_running, rate_limit, full_at, statement_timestamp() FROM pgjobs_queue
    WHERE name = %(queue)s FOR UPDATE SKIP LOCKED
"""
# A queue's rate limit: the starts a claim took, taken from its bucket (limits.py); a bucket
# spent at a lower rate than today's (%(most)s: its whole burst at today's) as spent at today's.
SPEND_QUEUE_RATE = """
    UPDATE pgjobs_queue
    SET full_at = GREATEST(LEAST(full_at, statement_timestamp() + make_interval(secs => %(most)s)),
                           statement_timestamp())
                  + make_interval(secs => %(seconds)s)
    WHERE name = %(queue)s
"""
QUEUE_CONTROLLED = "SELECT EXISTS (SELECT FROM pgjobs_queue WHERE name = %(queue)s)"
COUNT_RUNNING = "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND queue = %(queue)s"


# ---- limited tasks (limits.py) -----------------------------------------------------------------

# A limited task's jobs are claimed a limit key at a time, in two statements of one transaction.
#
# LOCK_KEYS looks at up to %(scan)s keys of %(queue)s with due jobs, each found by one probe of
# pgjobs_job_keyed_idx (a skip from one key to the next, not a read of every job): those after
# the key where the worker's last claim stopped (%(after_task)s, %(after_key)s; '' for the
# start), then from the start round to it, so the keys take turns across claims. It keeps up to
# %(limit)s of them that have room as far as its snapshot tells (a free slot, a start in their
# bucket: CLAIM_KEYED counts again after the locks), so that keys at their limit hold back none
# behind them. A key of a task with a rate or concurrency limit (%(locking)s) is kept only if
# this transaction gets its advisory lock, never waited for: a key another worker is claiming
# from sits this claim out. The rows: each kept key, then, unless it kept %(limit)s, the last key
# looked at, with the seconds until the first key held back by its rate gets a start, and how
# many were looked at.
LOCK_KEYS = """
    WITH RECURSIVE after_cursor AS (
        (SELECT task, limit_key FROM pgjobs_job
         WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
           AND queue = %(queue)s AND (task, limit_key) > (%(after_task)s, %(after_key)s)
         ORDER BY task, limit_key LIMIT 1)
        UNION ALL
        SELECT n.task, n.limit_key FROM after_cursor AS a CROSS JOIN LATERAL (
            SELECT task, limit_key FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
              AND queue = %(queue)s AND (task, limit_key) > (a.task, a.limit_key)
            ORDER BY task, limit_key LIMIT 1
        ) AS n
    ),
    from_start AS (
        (SELECT task, limit_key FROM pgjobs_job
         WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
           AND queue = %(queue)s AND (task, limit_key) <= (%(after_task)s, %(after_key)s)
         ORDER BY task, limit_key LIMIT 1)
        UNION ALL
        SELECT n.task, n.limit_key FROM from_start AS a CROSS JOIN LATERAL (
            SELECT task, limit_key FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
              AND queue = %(queue)s AND (task, limit_key) > (a.task, a.limit_key)
              AND (task, limit_key) <= (%(after_task)s, %(after_key)s)
            ORDER BY task, limit_key LIMIT 1
        ) AS n
    ),
    examined AS NOT MATERIALIZED (  -- read as far as kept asks (the keys found are kept)
        SELECT task, limit_key, row_number() OVER () AS n FROM (
            SELECT * FROM after_cursor UNION ALL SELECT * FROM from_start LIMIT %(scan)s
        ) AS k
    ),
    judged AS NOT MATERIALIZED (  -- judged as kept asks, up to the keys it keeps
        SELECT e.task, e.limit_key, e.n,
               l.concurrency IS NULL OR l.concurrency > (
                   SELECT count(*) FROM pgjobs_job AS r
                   WHERE r.status = 'running' AND r.limit_key IS NOT NULL
                     AND r.task = e.task AND r.limit_key = e.limit_key
               ) AS free,
               CASE WHEN b.full_at IS NOT NULL  -- none: a full bucket
                    THEN extract(epoch FROM LEAST(b.full_at, statement_timestamp()
                                                             + make_interval(secs => l.burst
                                                                                     * l.every))
                                            - statement_timestamp())::float8
                         - (l.burst - 1) * l.every
               END AS wait,
               -- spent at a lower rate (CLAIM_KEYED writes it as spent at today's)
               b.full_at > statement_timestamp() + make_interval(secs => l.burst * l.every)
               AS raised
        FROM examined AS e
        LEFT JOIN unnest(%(limited)s::text[], %(concurrency)s::int4[], %(every)s::float8[],
                         %(burst)s::int4[]) AS l(task, concurrency, every, burst)
               ON l.task = e.task
        LEFT JOIN pgjobs_bucket AS b ON b.task = e.task AND b.key = e.limit_key
    ),
    kept AS MATERIALIZED (
        SELECT task, limit_key FROM judged
        WHERE free AND (wait IS NULL OR wait <= 0 OR raised)
          AND CASE WHEN task = ANY (%(locking)s::text[])
                   THEN pg_try_advisory_xact_lock(%(lock_class)s,
                                                  hashtext(task || chr(31) || limit_key))
                   ELSE true END
        LIMIT %(limit)s
    )
    SELECT true AS kept, task, limit_key, NULL::float8 AS wait, NULL::int8 AS examined FROM kept
    UNION ALL
    (SELECT false, task, limit_key,
            CASE WHEN NOT EXISTS (SELECT FROM kept)
                 THEN (SELECT min(wait) FROM judged WHERE free AND wait > 0) END,
            (SELECT count(*) FROM examined)
     FROM examined WHERE (SELECT count(*) FROM kept) < %(limit)s ORDER BY n DESC LIMIT 1)
"""

# CLAIM_KEYED claims from the keys LOCK_KEYS kept (%(tasks)s, %(keys)s), in a snapshot taken
# after their locks: every claim and bucket written before is seen. Each key's room is the least
# of %(limit)s, its concurrency limit less its running jobs, and the starts its bucket holds
# (the bucket is full at full_at; one start comes back every `every` seconds, `burst` at most;
# one spent at a lower rate, before the limit was raised, counts as all spent at today's, and is
# written so).
# The keys take turns (each key's best job, then each key's second best, ...), and a key's
# bucket is spent by the jobs it took. The rows are the claimed jobs (JOB_COLUMNS), each with
# `wait`; when none was claimed, one row of NULLs with it: the seconds until the first of the
# keys held back by their rate gets a start again (NULL: none was).
CLAIM_KEYED = f"""
    WITH keys AS (
        -- A bucket spent at a lower rate than today's counts as spent at today's.
        SELECT k.task, k.key, k.turn_of, l.concurrency, l.every, l.burst, b.full_at AS stored,
               CASE WHEN b.full_at IS NOT NULL  -- none: a full bucket
                    THEN LEAST(b.full_at, statement_timestamp()
                                          + make_interval(secs => l.burst * l.every))
               END AS full_at
        FROM unnest(%(tasks)s::text[], %(keys)s::text[]) WITH ORDINALITY AS k(task, key, turn_of)
        LEFT JOIN unnest(%(limited)s::text[], %(concurrency)s::int4[], %(every)s::float8[],
                         %(burst)s::int4[]) AS l(task, concurrency, every, burst)
               ON l.task = k.task
        LEFT JOIN pgjobs_bucket AS b ON b.task = k.task AND b.key = k.key
    ),
    rooms AS (
        SELECT keys.*, GREATEST(0, LEAST(
            %(limit)s,
            keys.concurrency - (SELECT count(*) FROM pgjobs_job AS r
                                WHERE r.status = 'running' AND r.limit_key IS NOT NULL
                                  AND r.task = keys.task AND r.limit_key = keys.key),
            keys.burst - GREATEST(0, COALESCE(ceil(
                extract(epoch FROM keys.full_at - statement_timestamp()) / keys.every), 0))
        )) AS room
        FROM keys
    ),
    due AS (
        SELECT d.id, d.priority, d.run_at, r.turn_of
        FROM rooms AS r CROSS JOIN LATERAL (
            SELECT id, priority, run_at FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
              AND queue = %(queue)s AND task = r.task AND limit_key = r.key
              AND run_at <= statement_timestamp()
            ORDER BY priority DESC, run_at, id
            LIMIT r.room
            FOR UPDATE SKIP LOCKED
        ) AS d
    ),
    turns AS (
        SELECT id FROM due
        ORDER BY row_number() OVER (PARTITION BY turn_of ORDER BY priority DESC, run_at, id),
                 turn_of
        LIMIT %(limit)s
    ),
    {_TAKE_TURNS},
    spent AS (
        INSERT INTO pgjobs_bucket AS b (task, key, full_at)
        SELECT r.task, r.key, GREATEST(r.full_at, statement_timestamp())
                              + make_interval(secs => r.every * coalesce(c.n, 0))
        FROM rooms AS r
        LEFT JOIN (SELECT task, limit_key, count(*) AS n FROM claimed GROUP BY task, limit_key)
               AS c ON c.task = r.task AND c.limit_key = r.key
        WHERE r.every IS NOT NULL AND (c.n IS NOT NULL OR r.stored > r.full_at)
        ON CONFLICT (task, key) DO UPDATE SET full_at = EXCLUDED.full_at
    ),
    wait AS (
        SELECT min(extract(epoch FROM full_at - statement_timestamp()) - (burst - 1) * every)
               AS seconds
        FROM rooms
        WHERE room = 0 AND full_at > statement_timestamp()
                                     + make_interval(secs => (burst - 1) * every)
    )
    SELECT claimed.*, wait.seconds FROM claimed RIGHT JOIN wait ON true
"""

# A worker whose job of a concurrency-limited task ended wakes the workers of its queues: one of
# them may wait for that slot (unlike a rate's next start, nobody can tell when one frees).
WAKE_UP = "SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q"

# Buckets that are full again say no more than no row (CLAIM_KEYED reads a missing one as
# full): deleted by the pruner, a few at a time.
PRUNE_BUCKETS = """
    DELETE FROM pgjobs_bucket WHERE id = ANY (ARRAY(
        SELECT id FROM pgjobs_bucket WHERE full_at < statement_timestamp() LIMIT %(limit)s
    ))
    RETURNING id
"""


# ---- batches and dependencies (batches.py) -----------------------------------------------------

# Followed up after the commit that ended jobs, so that of two sessions ending a batch's last two
# members at once, the later sees both. Each moment happens once: the batch row's guard is
# checked again on the row as it is written, and its callbacks are inserted in the same statement.
#
# FINISH_BATCHES: the batches (%(batches)s, and those of the jobs %(jobs)s) with no live member
# complete (on_complete enqueued), and those whose jobs all succeeded, every one of its `size`,
# succeed (on_success enqueued), maybe after replays; a batch whose dead job was deleted never
# does. Each callback gets the batch's id and counts as `batch` beside its payload;
# %(channel)s (NULL: none) wakes its queue's workers. The rows: each batch moved, whether it
# completed and whether it succeeded.
FINISH_BATCHES = """
    WITH finished AS (
        SELECT b.id, b.completed_at FROM pgjobs_batch AS b
        WHERE b.id IN (SELECT unnest(%(batches)s::uuid[])
                       UNION SELECT batch_id FROM pgjobs_job
                             WHERE id = ANY (%(jobs)s::uuid[]) AND batch_id IS NOT NULL)
          AND b.succeeded_at IS NULL
          AND NOT EXISTS (SELECT FROM pgjobs_job AS j
                          WHERE j.batch_id = b.id AND j.status IN ('ready', 'running', 'waiting'))
          -- completed: it can only succeed now (so its jobs are counted only when it moves)
          AND (b.completed_at IS NULL
               OR NOT EXISTS (SELECT FROM pgjobs_job AS j
                              WHERE j.batch_id = b.id AND j.status IN ('failed', 'cancelled')))
    ),
    counted AS (
        SELECT f.id, f.completed_at, c.succeeded, c.failed, c.cancelled
        FROM finished AS f CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE j.status = 'succeeded') AS succeeded,
                   count(*) FILTER (WHERE j.status = 'failed') AS failed,
                   count(*) FILTER (WHERE j.status = 'cancelled') AS cancelled
            FROM pgjobs_job AS j WHERE j.batch_id = f.id
        ) AS c
    ),
    moved AS (
        UPDATE pgjobs_batch AS b
        SET completed_at = COALESCE(b.completed_at, statement_timestamp()),
            succeeded_at = CASE WHEN c.succeeded = b.size THEN statement_timestamp() END,
            succeeded = c.succeeded, failed = c.failed, cancelled = c.cancelled
        FROM counted AS c
        WHERE b.id = c.id AND b.succeeded_at IS NULL
          AND (b.completed_at IS NULL OR c.succeeded = b.size)
        RETURNING b.id, c.completed_at IS NULL AS completes, b.succeeded_at IS NOT NULL AS succeeds,
                  b.on_complete, b.on_success, b.succeeded, b.failed, b.cancelled
    ),
    callbacks AS (
        INSERT INTO pgjobs_job AS j (id, queue, task, payload, priority, max_attempts, limit_key)
        SELECT (cb->>'id')::uuid, cb->>'queue', cb->>'task',
               (cb->'payload') || jsonb_build_object('batch', jsonb_build_object(
                   'id', m.id, 'succeeded', m.succeeded, 'failed', m.failed,
                   'cancelled', m.cancelled)),
               (cb->>'priority')::int2, (cb->>'max_attempts')::int4, cb->>'limit_key'
        FROM moved AS m CROSS JOIN LATERAL (
            VALUES (CASE WHEN m.completes THEN m.on_complete END),
                   (CASE WHEN m.succeeds THEN m.on_success END)
        ) AS x(cb)
        WHERE cb IS NOT NULL
        ON CONFLICT (id) DO NOTHING
        RETURNING j.queue
    )
    SELECT m.id, m.completes, m.succeeds,
           (SELECT count(pg_notify(%(channel)s, q.queue))
            FROM (SELECT DISTINCT queue FROM callbacks) AS q WHERE %(channel)s IS NOT NULL)
    FROM moved AS m
"""

# RELEASE_WAITERS judges the jobs that wait (after=) for %(jobs)s or %(batches)s, and %(waiters)s
# themselves: a job whose dependencies all succeeded becomes ready; one whose dependency is a dead
# letter, cancelled or deleted (or a batch that completed without succeeding) is cancelled, the
# reason in last_error and that dependency marked `failed`. A job cancelled so (its last_error
# says it: an operator's cancel or a replay leaves another) is released again once its
# dependencies all succeed (the failed one replayed). A job released keeps a run_at still to
# come. The rows: each job moved, its new status and batch.
_DEPENDENCY_FAILED = """CASE
    WHEN d.after_job_id IS NOT NULL THEN a.id IS NULL OR a.status IN ('failed', 'cancelled')
    ELSE b.id IS NULL OR (b.completed_at IS NOT NULL AND b.succeeded_at IS NULL)
END"""
_WHY = """CASE
    WHEN d.after_job_id IS NOT NULL AND a.id IS NULL
        THEN 'job ' || d.after_job_id || ' was deleted'
    WHEN d.after_job_id IS NOT NULL AND a.status = 'failed'
        THEN 'job ' || a.id || ' (' || a.task || ') is a dead letter: ' || a.last_error
    WHEN d.after_job_id IS NOT NULL THEN 'job ' || a.id || ' (' || a.task || ') was cancelled'
    WHEN b.id IS NULL THEN 'batch ' || d.after_batch_id || ' was deleted'
    ELSE 'batch ' || b.id || ' completed with ' || b.failed || ' dead and ' || b.cancelled
         || ' cancelled of ' || b.size || ' jobs'
END"""
RELEASE_WAITERS = f"""
    WITH candidates AS (
        SELECT job_id AS id FROM pgjobs_dependency WHERE after_job_id = ANY (%(jobs)s::uuid[])
        UNION
        SELECT job_id FROM pgjobs_dependency WHERE after_batch_id = ANY (%(batches)s::uuid[])
        UNION
        SELECT unnest(%(waiters)s::uuid[])
    ),
    judged AS (
        SELECT w.id, w.status = 'cancelled' AS revived,
               bool_and(CASE WHEN d.after_job_id IS NOT NULL THEN a.status = 'succeeded'
                             ELSE b.succeeded_at IS NOT NULL END IS TRUE) AS released,
               (array_agg(d.id ORDER BY d.id) FILTER (WHERE {_DEPENDENCY_FAILED}))[1] AS failing,
               (array_agg({_WHY} ORDER BY d.id) FILTER (WHERE {_DEPENDENCY_FAILED}))[1] AS why
        FROM pgjobs_job AS w
        JOIN pgjobs_dependency AS d ON d.job_id = w.id
        LEFT JOIN pgjobs_job AS a ON a.id = d.after_job_id
        LEFT JOIN pgjobs_batch AS b ON b.id = d.after_batch_id
        WHERE w.id IN (SELECT id FROM candidates)
          AND (w.status = 'waiting'
               OR (w.status = 'cancelled' AND w.last_error LIKE 'DependencyFailed: %%'))
        GROUP BY w.id
    ),
    moved AS (
        UPDATE pgjobs_job AS w
        SET status = CASE WHEN jd.released THEN 'ready' ELSE 'cancelled' END,
            run_at = CASE WHEN jd.released THEN GREATEST(w.run_at, statement_timestamp())
                          ELSE w.run_at END,
            scheduled = jd.released AND w.run_at > statement_timestamp(),
            finished_at = CASE WHEN jd.released THEN NULL ELSE statement_timestamp() END,
            last_error = CASE WHEN jd.released THEN '' ELSE 'DependencyFailed: ' || jd.why END
        FROM judged AS jd
        WHERE w.id = jd.id
          AND CASE WHEN jd.released
                   THEN w.status = 'waiting' OR (w.status = 'cancelled' AND jd.revived)
                   ELSE w.status = 'waiting' AND jd.failing IS NOT NULL END
        RETURNING w.id, w.status, w.batch_id
    ),
    marked AS (
        UPDATE pgjobs_dependency AS d SET failed = (m.status = 'cancelled' AND d.id = jd.failing)
        FROM moved AS m JOIN judged AS jd ON jd.id = m.id
        WHERE d.job_id = m.id
    )
    SELECT id, status, batch_id FROM moved
"""

# A job enqueued with after=: what each id it names is (a job, with its queue, or a batch, or
# neither: an EnqueueError), then its dependencies, written in the enqueue's transaction.
DEPENDENCIES_FOUND = """
    SELECT g.id, j.queue, EXISTS (SELECT FROM pgjobs_batch AS b WHERE b.id = g.id)
    FROM unnest(%(ids)s::uuid[]) AS g(id)
    LEFT JOIN pgjobs_job AS j ON j.id = g.id
"""
ADD_DEPENDENCIES = """
    INSERT INTO pgjobs_dependency (job_id, after_job_id, after_batch_id, failed)
    SELECT %(job)s::uuid, j, NULL, false FROM unnest(%(jobs)s::uuid[]) AS j
    UNION ALL
    SELECT %(job)s::uuid, NULL, b, false FROM unnest(%(batches)s::uuid[]) AS b
    RETURNING id
"""

# What a worker's sweep follows up in case a follow-up was lost (its session died after the
# commit): batches not yet succeeded, waiting jobs, and jobs a dependency cancelled (by the
# dependency that did), each from after the last one the sweep looked at (%(after)s), a few at
# a time.
OPEN_BATCHES = """
    SELECT id FROM pgjobs_batch
    WHERE succeeded_at IS NULL AND id > %(after)s::uuid ORDER BY id LIMIT %(limit)s
"""
WAITING_JOBS = """
    SELECT id FROM pgjobs_job
    WHERE status = 'waiting' AND id > %(after)s::uuid ORDER BY id LIMIT %(limit)s
"""
REVIVABLE_JOBS = """
    SELECT id, job_id FROM pgjobs_dependency
    WHERE failed AND id > %(after)s::int8 ORDER BY id LIMIT %(limit)s
"""

# Dependencies and batches left without jobs (pruned or deleted), deleted a few at a time.
PRUNE_DEPENDENCIES = """
    DELETE FROM pgjobs_dependency WHERE id = ANY (ARRAY(
        SELECT d.id FROM pgjobs_dependency AS d
        WHERE NOT EXISTS (SELECT FROM pgjobs_job WHERE pgjobs_job.id = d.job_id)
        LIMIT %(limit)s
    ))
    RETURNING id
"""
PRUNE_BATCHES = """
    DELETE FROM pgjobs_batch WHERE id = ANY (ARRAY(
        SELECT b.id FROM pgjobs_batch AS b
        WHERE b.completed_at < statement_timestamp() - make_interval(secs => %(older_than)s)
          AND NOT EXISTS (SELECT FROM pgjobs_job WHERE pgjobs_job.batch_id = b.id)
        LIMIT %(limit)s
    ))
    RETURNING id
"""


def errors_kept(count: int) -> str:
    """The jsonpath that keeps the last `count` entries of an error history."""
    return f"$[last - {max(count, 1) - 1} to last]"


# ---- the outbox of queues carried by NATS JetStream (transports.py, jetstream/) --------------

# The relay's claim: due rows of the NATS queues, taken per queue as the worker's claim takes
# them (SKIP LOCKED), locked until the round's transaction ends. Only rows whose messages the
# stream acknowledged are deleted (RELAYED, same transaction); the others stay for the next
# round (JetStream drops a repeated message id within its duplicate window).
RELAY = f"""
    SELECT {_CLAIMED} FROM pgjobs_job AS j
    WHERE j.id = ANY (ARRAY(
        SELECT d.id
        FROM unnest(%(queues)s::text[]) AS q(name)
        CROSS JOIN LATERAL (
            SELECT id FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = q.name
              AND run_at <= statement_timestamp()
            ORDER BY priority DESC, run_at, id
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS d
        UNION ALL
        SELECT s.id
        FROM unnest(%(queues)s::text[]) AS q(name)
        CROSS JOIN LATERAL (
            SELECT id FROM pgjobs_job
            WHERE status = 'ready' AND scheduled AND limit_key IS NULL AND queue = q.name
              AND run_at <= statement_timestamp()
            ORDER BY run_at, id
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS s
    )) AND j.status = 'ready'
"""

# A NATS job's outbox row that an older delivery of it wrote (a retry handed back whose
# acknowledgement was lost): the delivery that ran after it supersedes it. SKIP LOCKED: a row
# a relay is publishing is left to it.
SUPERSEDED = """
    DELETE FROM pgjobs_job
    WHERE id = ANY (ARRAY(
        SELECT id FROM pgjobs_job
        WHERE id = %(id)s AND status = 'ready' AND claims < %(below)s
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING id
"""

# The outbox rows a relay round is done with (stored by the stream, or refused), among those
# it locked (RELAY).
RELAYED = """
    DELETE FROM pgjobs_job WHERE id = ANY (%(ids)s::uuid[]) AND status = 'ready' RETURNING id
"""

# A job run from NATS whose attempt failed comes back as a running row held by the consumer,
# so that SETTLE_AND_CLAIM's failed part decides what follows. No unique_key: it held the key
# only in the outbox. When a row with this id exists, its status and claims come back instead.
WRITE_BACK = """
    WITH inserted AS (
        INSERT INTO pgjobs_job AS j
            (id, queue, task, payload, status, priority, run_at, attempts, max_attempts,
             leased_until, worker, errors, created_at, started_at, claims, headers)
        VALUES (
            %(id)s, %(queue)s, %(task)s, %(payload)s::jsonb, 'running', %(priority)s,
            %(run_at)s, %(attempts)s, %(max_attempts)s, statement_timestamp(), %(worker)s,
            %(errors)s::jsonb, %(created_at)s, statement_timestamp(), %(claims)s,
            %(headers)s::jsonb
        )
        ON CONFLICT (id) DO NOTHING
        RETURNING j.id
    )
    SELECT true, NULL::text, NULL::int FROM inserted
    UNION ALL
    SELECT false, status, claims FROM pgjobs_job
    WHERE id = %(id)s AND NOT EXISTS (SELECT FROM inserted)
"""
