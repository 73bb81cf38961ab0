"""The queues' figures: their depth now, what workers did recently, and which workers are alive.

Depth and age come from the job table's partial indexes; throughput, retries, claim latency and
who is alive from the workers' QueueStat rows. No query reads the finished history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, router

from django_pgjobs import limits, registry

# The models are imported inside the functions that need them: this module and those built on
# it may be imported before the app registry is ready (AppRegistryNotReady).

#: The windows (seconds) over which worker activity is summed: 1, 5 and 15 minutes.
WINDOWS = (60, 300, 900)
#: A worker is alive while its last row is younger than this many of its intervals (+ slack).
ALIVE_INTERVALS = 2
ALIVE_SLACK = 5.0


@dataclass(frozen=True)
class QueueDepth:
    """A queue's jobs now, by state, with its controls."""

    queue: str
    due: int  # ready and run_at <= now(): waiting for a worker
    scheduled: int  # ready, run_at in the future (including retries waiting out their backoff)
    retrying: int  # ready after at least one failed attempt
    running: int
    failed: int  # dead letters
    oldest_due_seconds: float  # how long the oldest due job has waited: the latency to watch
    paused: bool = False
    max_running: int | None = None
    rate_limit: str | None = None
    # Running jobs whose lease has run out (their worker gone), and since when.
    expired: int = 0
    oldest_expired_seconds: float = 0.0


@dataclass(frozen=True)
class QueueActivity:
    """What all workers recorded for one queue over the last `window` seconds."""

    queue: str
    window: int
    claimed: int
    succeeded: int
    retried: int
    failed: int
    #: Claims per latency bucket (see models.LATENCY_BUCKETS), summed over workers and rows.
    latency_buckets: list[int] = field(default_factory=list)
    #: The seconds the rows cover: the window, or less when the first row began within it.
    covered: float = 0.0

    @property
    def attempts(self) -> int:
        return self.succeeded + self.retried + self.failed

    @property
    def throughput(self) -> float:
        """Jobs finished (succeeded or dead-lettered) per second of the time covered."""
        return (self.succeeded + self.failed) / max(self.covered or self.window, 1.0)

    @property
    def retry_rate(self) -> float:
        """The share of finished attempts that failed and were retried."""
        return self.retried / self.attempts if self.attempts else 0.0

    def latency(self, quantile: float) -> float | None:
        return latency_quantile(self.latency_buckets, quantile)


@dataclass(frozen=True)
class WorkerStats:
    """A worker seen in the last 15 minutes: the queues it serves, whether it is alive, and
    whether it stopped (and said so) rather than went silent."""

    worker: str
    queues: list[str]
    last_seen_seconds: float
    alive: bool
    stopped: bool = False


@dataclass(frozen=True)
class QueueYield:
    """How a queue yields to the application (runtime/controls.py), from the last report of each
    live worker that serves it."""

    queue: str
    workers: int
    yielding: int  # of them, those yielding at their last report
    yielded: float  # the share of the time their last reports cover that they yielded
    allowed: float | None  # jobs/s the yielding ones may claim, together; None: none yields
    claimed: float  # jobs/s they all claimed
    open_ms: float | None  # the application's open transaction time, smoothed
    baseline_ms: float | None  # and its baseline: None until measured

    def describe(self) -> str:
        """One line: whether the queue yields, how much, and why."""
        signal = ""
        if self.open_ms is not None and self.baseline_ms is not None:
            signal = (
                f"the application's open transactions add up to {self.open_ms:.1f} ms against "
                f"a baseline of {self.baseline_ms:.1f} ms"
            )
        elif self.open_ms is not None:
            signal = "no baseline measured yet"
        if not self.yielding:
            return f"not yielding ({signal})" if signal else "not yielding"
        workers = "" if self.workers == 1 else f"{self.yielding} of {self.workers} workers, "
        return (
            f"yielding ({workers}{self.yielded:.0%} of their last reports' time): {signal}; "
            f"allowed {self.allowed or 0:,.0f} jobs/s, claiming {self.claimed:,.0f} jobs/s"
        )


@dataclass(frozen=True)
class LimitUse:
    """A limited task's jobs now (limits.py): due and waiting, and running, and over how many
    limit keys; its limits as this process registers them ("" when it does not know the task)."""

    task: str
    limits: str
    waiting: int
    waiting_keys: int
    running: int
    running_keys: int


@dataclass(frozen=True)
class BatchStats:
    """The batches not yet succeeded (batches.py): `open` ones, whose jobs are not all finished,
    and those that completed without succeeding (failed or cancelled jobs, to replay); and the
    jobs `waiting` (after=) for jobs or batches to succeed. `readable` False: the database user
    may not read pgjobs_batch (a role granted the tables jobstats read before it), so the
    batches are not counted."""

    open: int = 0
    completed_not_succeeded: int = 0
    waiting: int = 0
    readable: bool = True


@dataclass(frozen=True)
class StreamStats:
    """A queue carried by NATS JetStream (transports.py): its stream and durable consumer, as
    the server reports them; its outbox is the queue's due jobs in QueueDepth."""

    queue: str
    stream: str
    consumer: str
    reachable: bool  # False: the server could not be asked (see error)
    error: str = ""
    messages: int = 0  # in the stream, acknowledged or not (its retention keeps them)
    pending: int = 0  # not yet delivered to any worker of the consumer
    ack_pending: int = 0  # delivered and not yet acknowledged: running, or lost with a worker
    redelivered: int = 0  # delivered more than once and not yet acknowledged
    # How long the oldest message not yet delivered has been due; None: none, or unread (age_error).
    oldest_pending_seconds: float | None = None
    age_error: str = ""
    # The same of the oldest message delivered and not acknowledged (ack_pending).
    oldest_unacked_seconds: float | None = None


def served_queues(workers: Iterable[WorkerStats]) -> set[str]:
    """The queues that at least one live worker takes jobs from."""
    return {queue for worker in workers if worker.alive for queue in worker.queues}


def window_label(window: int) -> str:
    """How reports name a window: "1m", "5m", "15m"."""
    return f"{window // 60}m"


def latency_quantile(buckets: list[int], quantile: float) -> float | None:
    """Estimate a quantile of the claim latency from histogram counts, as Prometheus's
    histogram_quantile does: linear within the bucket it falls in. Claims above the last bound
    are reported as that bound. None when nothing was claimed."""
    from django_pgjobs.models import LATENCY_BUCKETS  # not at the top: see the imports

    total = sum(buckets)
    if not total:
        return None
    rank, seen, lower = quantile * total, 0, 0.0
    for upper, count in zip(LATENCY_BUCKETS, buckets, strict=False):
        if count and seen + count >= rank:
            return lower + (upper - lower) * (rank - seen) / count
        seen, lower = seen + count, float(upper)
    return float(LATENCY_BUCKETS[-1])


def job_database(db: str | None = None) -> str:
    """`db`, or the database the job table is written to."""
    from django_pgjobs.models import Job  # not at the top: see the imports

    return db or router.db_for_write(Job)


# One branch per status, each with a literal `status = '…'` so that it reads only its partial
# index's rows (a bound parameter or an IN list would not match the index predicates).
QUEUES_SQL = """
    SELECT queue, sum(due), sum(scheduled), sum(retrying), sum(running), sum(failed),
           COALESCE(EXTRACT(EPOCH FROM now() - min(oldest_due)), 0),
           sum(expired), COALESCE(EXTRACT(EPOCH FROM now() - min(oldest_expired)), 0)
    FROM (
        SELECT queue,
               count(*) FILTER (WHERE run_at <= now()) AS due,
               count(*) FILTER (WHERE run_at > now()) AS scheduled,
               count(*) FILTER (WHERE attempts > 0) AS retrying,
               0 AS running, 0 AS failed,
               min(run_at) FILTER (WHERE run_at <= now()) AS oldest_due,
               0 AS expired, NULL::timestamptz AS oldest_expired
        FROM (  -- each part through its own partial index
            SELECT queue, run_at, attempts FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL
            UNION ALL
            SELECT queue, run_at, attempts FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
            UNION ALL
            SELECT queue, run_at, attempts FROM pgjobs_job WHERE status = 'ready' AND scheduled
        ) AS ready
        GROUP BY queue
        UNION ALL
        SELECT queue, 0, 0, 0, count(*), 0, NULL,
               count(*) FILTER (WHERE leased_until < now()),
               min(leased_until) FILTER (WHERE leased_until < now())
        FROM pgjobs_job WHERE status = 'running' GROUP BY queue
        UNION ALL
        SELECT queue, 0, 0, 0, 0, count(*), NULL, 0, NULL FROM pgjobs_job
        WHERE status = 'failed' GROUP BY queue
    ) AS per_status
    GROUP BY queue
"""


def queue_depths(db: str | None = None, also: Iterable[str] = ()) -> list[QueueDepth]:
    """Every queue that has live or failed jobs or a Queue row (its controls), and those named
    in `also` (queues that workers serve or recently worked on)."""
    from django_pgjobs.models import Queue  # not at the top: see the imports

    db = job_database(db)
    with connections[db].cursor() as cursor:
        cursor.execute(QUEUES_SQL)
        rows = {row[0]: row for row in cursor.fetchall()}
    controls = {queue.name: queue for queue in Queue.objects.using(db)}
    depths = []
    for name in sorted(rows.keys() | controls.keys() | set(also)):
        _, due, scheduled, retrying, running, failed, oldest, expired, expired_for = rows.get(
            name, (name, 0, 0, 0, 0, 0, 0, 0, 0)
        )
        control = controls.get(name)
        depths.append(
            QueueDepth(
                name,
                int(due),
                int(scheduled),
                int(retrying),
                int(running),
                int(failed),
                float(oldest),
                paused=bool(control and control.paused),
                max_running=control.max_running if control else None,
                rate_limit=(control.rate_limit or None) if control else None,
                expired=int(expired),
                oldest_expired_seconds=float(expired_for),
            )
        )
    return depths


# Rows of the longest window only (the index on `at`), each counted in every window it is in;
# rows stamped in the future (the clock stepped back) would count a dead worker as alive.
ACTIVITY_SQL = """
    SELECT s.queue, w.seconds, sum(s.claimed), sum(s.succeeded), sum(s.retried), sum(s.failed),
           least(w.seconds,
                 EXTRACT(EPOCH FROM now() - min(s.at - make_interval(secs => s.seconds))))
    FROM pgjobs_queuestat AS s
    JOIN unnest(%(windows)s::int[]) AS w(seconds)
      ON s.at > now() - make_interval(secs => w.seconds)
    WHERE s.at > now() - make_interval(secs => %(longest)s) AND s.at <= statement_timestamp()
    GROUP BY 1, 2
"""
BUCKETS_SQL = """
    SELECT s.queue, w.seconds, b.n, sum(b.count::bigint)
    FROM pgjobs_queuestat AS s
    JOIN unnest(%(windows)s::int[]) AS w(seconds)
      ON s.at > now() - make_interval(secs => w.seconds)
    CROSS JOIN LATERAL jsonb_array_elements_text(s.latency_buckets) WITH ORDINALITY AS b(count, n)
    WHERE s.at > now() - make_interval(secs => %(longest)s) AND s.at <= statement_timestamp()
    GROUP BY 1, 2, 3
"""


def activity_stats(
    db: str | None = None, windows: tuple[int, ...] = WINDOWS
) -> list[QueueActivity]:
    """Per queue and window, what workers recorded in the QueueStat rows written within it."""
    params: dict[str, Any] = {"windows": list(windows), "longest": max(windows)}
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(ACTIVITY_SQL, params)
        counts = cursor.fetchall()
        cursor.execute(BUCKETS_SQL, params)
        buckets: dict[tuple[str, int], dict[int, int]] = {}
        for queue, window, n, count in cursor.fetchall():
            buckets.setdefault((queue, window), {})[n] = int(count)
    activity = []
    for queue, window, claimed, succeeded, retried, failed, covered in sorted(counts):
        by_n = buckets.get((queue, window), {})
        histogram = [by_n.get(n, 0) for n in range(1, max(by_n, default=0) + 1)]
        activity.append(
            QueueActivity(
                queue,
                window,
                int(claimed),
                int(succeeded),
                int(retried),
                int(failed),
                histogram,
                float(covered),
            )
        )
    return activity


# A worker that stops writes rows of `seconds = 0` after its last report (activity.stopped_rows):
# from then on it is not alive, however recent its last report. Worker ids are never reused.
WORKERS_SQL = """
    SELECT worker, array_agg(DISTINCT queue ORDER BY queue),
           EXTRACT(EPOCH FROM now() - max(at)),
           bool_or(at + make_interval(secs => %(intervals)s * seconds + %(slack)s) >= now())
             AND NOT bool_or(seconds = 0),
           bool_or(seconds = 0)
    FROM pgjobs_queuestat
    WHERE at > now() - make_interval(secs => %(longest)s) AND at <= statement_timestamp()
    GROUP BY worker ORDER BY worker
"""


def worker_stats(db: str | None = None) -> list[WorkerStats]:
    """Workers that wrote a QueueStat row in the last 15 minutes: the queues they serve, whether
    they are alive (a row within their last two intervals, and not stopped), and stopped."""
    params = {"intervals": ALIVE_INTERVALS, "slack": ALIVE_SLACK, "longest": max(WINDOWS)}
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(WORKERS_SQL, params)
        return [
            WorkerStats(worker, list(queues), float(seen), bool(alive), bool(stopped))
            for worker, queues, seen, alive, stopped in cursor.fetchall()
        ]


# Each live worker's last report per queue, in the last minute (rows of seconds = 0 say it
# stopped); the queue's figures are their sums (jobs/s) and averages (the signal: one database).
YIELD_SQL = """
    WITH recent AS (
        SELECT * FROM pgjobs_queuestat
        WHERE at > now() - make_interval(secs => %(window)s) AND at <= statement_timestamp()
    ), latest AS (
        SELECT DISTINCT ON (worker, queue) * FROM recent
        WHERE seconds > 0 AND worker NOT IN (SELECT worker FROM recent WHERE seconds = 0)
        ORDER BY worker, queue, at DESC
    )
    SELECT queue, count(*), count(allowed), sum(yielded) / sum(seconds), sum(allowed),
           sum(claimed / seconds), avg(open_ms), avg(baseline_ms)
    FROM latest GROUP BY queue ORDER BY queue
"""


# Each through its own partial index (pgjobs_job_keyed_idx, pgjobs_job_keyed_running_idx).
LIMIT_SQL = """
    SELECT task, count(*) FILTER (WHERE waiting),
           count(DISTINCT limit_key) FILTER (WHERE waiting),
           count(*) FILTER (WHERE NOT waiting),
           count(DISTINCT limit_key) FILTER (WHERE NOT waiting)
    FROM (
        SELECT task, limit_key, true AS waiting FROM pgjobs_job
        WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL AND run_at <= now()
        UNION ALL
        SELECT task, limit_key, false FROM pgjobs_job
        WHERE status = 'running' AND limit_key IS NOT NULL
    ) AS limited
    GROUP BY task ORDER BY task
"""


def limit_stats(db: str | None = None) -> list[LimitUse]:
    """Per limited task with jobs due or running, how many wait and run, over how many keys."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(LIMIT_SQL)
        found = cursor.fetchall()
    known = registry.all_tasks()
    return [
        LimitUse(task, limits.describe(known[task]) if task in known else "", *map(int, counts))
        for task, *counts in found
    ]


# The batches through pgjobs_batch_open_idx (those not yet succeeded), the waiting jobs through
# pgjobs_job_waiting_idx: a literal `status = 'waiting'`, which its predicate matches.
BATCHES_SQL = """
    SELECT count(*) FILTER (WHERE completed_at IS NULL),
           count(*) FILTER (WHERE completed_at IS NOT NULL)
    FROM pgjobs_batch WHERE succeeded_at IS NULL
"""
WAITING_SQL = "SELECT count(*) FROM pgjobs_job WHERE status = 'waiting'"
# Whether the report's database user may read the batches (a missing table: "run migrate").
BATCHES_READABLE_SQL = "SELECT has_table_privilege('pgjobs_batch', 'SELECT')"


def batch_stats(db: str | None = None) -> BatchStats:
    """How many batches are open and completed without succeeding, and how many jobs wait."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(WAITING_SQL)
        (waiting,) = cursor.fetchone()
        cursor.execute(BATCHES_READABLE_SQL)
        (readable,) = cursor.fetchone()
        if not readable:
            return BatchStats(waiting=int(waiting), readable=False)
        cursor.execute(BATCHES_SQL)
        open_, completed = cursor.fetchone()
    return BatchStats(int(open_), int(completed), int(waiting))


def yield_stats(db: str | None = None) -> list[QueueYield]:
    """Per queue served in the last minute, how it yields to the application."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(YIELD_SQL, {"window": min(WINDOWS)})
        found = cursor.fetchall()
    return [
        QueueYield(
            queue,
            int(workers),
            int(yielding),
            min(1.0, float(yielded or 0)),
            _float(allowed),
            float(claimed or 0),
            _float(open_ms),
            _float(baseline_ms),
        )
        for queue, workers, yielding, yielded, allowed, claimed, open_ms, baseline_ms in found
    ]


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
