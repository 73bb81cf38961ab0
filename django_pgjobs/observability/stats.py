"""The queues' figures: their depth now, what workers did recently, and which workers are alive.

Depth and age come from the job table's partial indexes; throughput, retries, claim latency and
who is alive from the workers' QueueStat rows. No query reads the finished history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import zip_longest
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


def latency_quantile(buckets: list[int], q: float) -> float | None:
    """A quantile of the claim latency from its histogram over LATENCY_BUCKETS."""
    from django_pgjobs.models import LATENCY_BUCKETS  # not at the top: see the imports

    return quantile(buckets, q, LATENCY_BUCKETS)


def quantile(counts: list[int], q: float, bounds: tuple[float, ...]) -> float | None:
    """Estimate a quantile from histogram counts over `bounds` (upper bounds; the last count
    holds the rest), as Prometheus's histogram_quantile does: linear within the bucket it falls
    in. Counts above the last bound are reported as that bound. None when there are none."""
    total = sum(counts)
    if not total:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for upper, count in zip(bounds, counts, strict=False):
        if count and seen + count >= rank:
            return lower + (upper - lower) * (rank - seen) / count
        seen, lower = seen + count, float(upper)
    return float(bounds[-1])


def job_database(db: str | None = None) -> str:
    """`db`, or the database the job table is written to."""
    from django_pgjobs.models import Job  # not at the top: see the imports

    return db or router.db_for_write(Job)


# One branch per status, each with a literal `status = '…'` so that it reads only its partial
# index's rows (a bound parameter or an IN list would not match the index predicates); per queue
# and task, which queue_depths and task_depths add up.
QUEUES_SQL = """
    SELECT queue, task, sum(due), sum(scheduled), sum(retrying), sum(running), sum(failed),
           COALESCE(EXTRACT(EPOCH FROM now() - min(oldest_due)), 0),
           sum(expired), COALESCE(EXTRACT(EPOCH FROM now() - min(oldest_expired)), 0)
    FROM (
        SELECT queue, task,
               count(*) FILTER (WHERE run_at <= now()) AS due,
               count(*) FILTER (WHERE run_at > now()) AS scheduled,
               count(*) FILTER (WHERE attempts > 0) AS retrying,
               0 AS running, 0 AS failed,
               min(run_at) FILTER (WHERE run_at <= now()) AS oldest_due,
               0 AS expired, NULL::timestamptz AS oldest_expired
        FROM (  -- each part through its own partial index
            SELECT queue, task, run_at, attempts FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL
            UNION ALL
            SELECT queue, task, run_at, attempts FROM pgjobs_job
            WHERE status = 'ready' AND NOT scheduled AND limit_key IS NOT NULL
            UNION ALL
            SELECT queue, task, run_at, attempts FROM pgjobs_job
            WHERE status = 'ready' AND scheduled
        ) AS ready
        GROUP BY queue, task
        UNION ALL
        SELECT queue, task, 0, 0, 0, count(*), 0, NULL,
               count(*) FILTER (WHERE leased_until < now()),
               min(leased_until) FILTER (WHERE leased_until < now())
        FROM pgjobs_job WHERE status = 'running' GROUP BY queue, task
        UNION ALL
        SELECT queue, task, 0, 0, 0, 0, count(*), NULL, 0, NULL FROM pgjobs_job
        WHERE status = 'failed' GROUP BY queue, task
    ) AS per_status
    GROUP BY queue, task
"""


@dataclass(frozen=True)
class Depth:
    """The jobs of a queue and task now, by state (QUEUES_SQL's row)."""

    queue: str
    task: str
    due: int
    scheduled: int
    retrying: int
    running: int
    failed: int
    oldest_due_seconds: float
    expired: int
    oldest_expired_seconds: float


def depths(db: str | None = None) -> list[Depth]:
    """The live and failed jobs by queue and task."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(QUEUES_SQL)
        found = cursor.fetchall()
    shown = []
    for queue, task, due, scheduled, retrying, running, failed, oldest, expired, since in found:
        counts = (int(due), int(scheduled), int(retrying), int(running), int(failed))
        shown.append(Depth(queue, task, *counts, float(oldest), int(expired), float(since)))
    return shown


def added_up(rows: list[Depth]) -> dict[str, int | float]:
    """Several rows of depths as one: the counts summed, the oldest ages the oldest."""
    return {
        "due": sum(r.due for r in rows),
        "scheduled": sum(r.scheduled for r in rows),
        "retrying": sum(r.retrying for r in rows),
        "running": sum(r.running for r in rows),
        "failed": sum(r.failed for r in rows),
        "oldest_due_seconds": max((r.oldest_due_seconds for r in rows), default=0.0),
        "expired": sum(r.expired for r in rows),
        "oldest_expired_seconds": max((r.oldest_expired_seconds for r in rows), default=0.0),
    }


def queue_depths(
    db: str | None = None, also: Iterable[str] = (), found: list[Depth] | None = None
) -> list[QueueDepth]:
    """Every queue that has live or failed jobs or a Queue row (its controls), and those named
    in `also` (queues that workers serve or recently worked on); from `found` (depths()) when
    given."""
    from django_pgjobs.models import Queue  # not at the top: see the imports

    db = job_database(db)
    by_queue: dict[str, list[Depth]] = {}
    for row in depths(db) if found is None else found:
        by_queue.setdefault(row.queue, []).append(row)
    controls = {queue.name: queue for queue in Queue.objects.using(db)}
    shown = []
    for name in sorted(by_queue.keys() | controls.keys() | set(also)):
        control = controls.get(name)
        shown.append(
            QueueDepth(
                name,
                **added_up(by_queue.get(name, [])),  # type: ignore[arg-type]
                paused=bool(control and control.paused),
                max_running=control.max_running if control else None,
                rate_limit=(control.rate_limit or None) if control else None,
            )
        )
    return shown


# The minutes (Rollup rows) of the longest window, through the rollup's unique index; rows
# stamped in the future (the clock stepped back) are left out.
ACTIVITY_SQL = """
    SELECT name, EXTRACT(EPOCH FROM now() - at), EXTRACT(EPOCH FROM now() - since), claimed,
           succeeded, retried, failed, latency
    FROM pgjobs_rollup
    WHERE kind = 'queue' AND step = 60
      AND at > now() - make_interval(secs => %(longest)s + 60) AND at <= statement_timestamp()
"""


def activity_stats(
    db: str | None = None, windows: tuple[int, ...] = WINDOWS
) -> list[QueueActivity]:
    """Per queue and window, what workers recorded in the minutes that overlap it: a window's
    counts are to the minute, and its rates over the time its minutes cover."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(ACTIVITY_SQL, {"longest": max(windows)})
        minutes = cursor.fetchall()
    activity = []
    for window in windows:
        by_queue: dict[str, list[Any]] = {}
        for queue, age, covered, *counts, latency in minutes:
            if age < window + 60:  # the minute began less than a minute before the window
                by_queue.setdefault(queue, []).append((float(covered), counts, latency))
        for queue, rows in sorted(by_queue.items()):
            histogram = [sum(column) for column in zip_longest(*(r[2] for r in rows), fillvalue=0)]
            claimed, succeeded, retried, failed = (
                sum(c) for c in zip(*(r[1] for r in rows), strict=True)
            )
            covered = min(max(r[0] for r in rows), window + 60.0)
            activity.append(
                QueueActivity(
                    queue, window, claimed, succeeded, retried, failed, histogram, covered
                )
            )
    return sorted(activity, key=lambda a: (a.queue, a.window))


# Each worker as its last report left it (pgjobs_worker, kept by the rollup's trigger); a worker
# that stopped said so in its last report, and worker ids are never reused.
WORKERS_SQL = """
    SELECT name, queues, EXTRACT(EPOCH FROM now() - seen_at),
           seen_at + make_interval(secs => %(intervals)s * seconds + %(slack)s) >= now()
             AND NOT stopped,
           stopped
    FROM pgjobs_worker
    WHERE seen_at > now() - make_interval(secs => %(longest)s)
      AND seen_at <= statement_timestamp()
    ORDER BY name
"""


def worker_stats(db: str | None = None) -> list[WorkerStats]:
    """Workers that reported in the last 15 minutes: the queues they serve, whether they are
    alive (a report within their last two intervals, and not stopped), and stopped."""
    params = {"intervals": ALIVE_INTERVALS, "slack": ALIVE_SLACK, "longest": max(WINDOWS)}
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(WORKERS_SQL, params)
        return [
            WorkerStats(worker, list(queues), float(seen), bool(alive), bool(stopped))
            for worker, queues, seen, alive, stopped in cursor.fetchall()
        ]


# Each live worker's last report per queue (pgjobs_worker's yielding), if within the last
# minute; the queue's figures are their sums (jobs/s) and averages (the signal: one database).
YIELD_SQL = """
    SELECT q.key, count(*), count(r.allowed), sum(r.yielded) / sum(r.seconds), sum(r.allowed),
           sum(r.claimed / r.seconds), avg(r.open_ms), avg(r.baseline_ms)
    FROM pgjobs_worker AS w
    CROSS JOIN jsonb_each(w.yielding) AS q
    CROSS JOIN jsonb_to_record(q.value) AS r(seconds float, yielded float, allowed float,
                                             claimed float, open_ms float, baseline_ms float)
    WHERE w.seen_at > now() - make_interval(secs => %(window)s)
      AND w.seen_at <= statement_timestamp() AND NOT w.stopped AND r.seconds > 0
    GROUP BY q.key ORDER BY q.key
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
