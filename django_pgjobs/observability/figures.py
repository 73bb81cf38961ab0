"""Every figure of stats and dbstats at one moment: what the health verdict judges.

Kept apart from the report so that the verdict (health) can read the figures while the report
(report) holds the verdict: figures ← health ← report, with no cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections, transaction

from django_pgjobs.conf import get_settings
from django_pgjobs.observability import dbstats, stats
from django_pgjobs.observability.load import QueueLoad, queue_load


@dataclass(frozen=True)
class Figures:
    """The queues, their recent activity, the workers, the job table, the database and the
    queue's share of its active time."""

    at: datetime  # the database's clock when the figures were taken
    queues: list[stats.QueueDepth]
    activity: list[stats.QueueActivity]
    workers: list[stats.WorkerStats]
    table: dbstats.TableStats
    database: dbstats.DatabaseStats
    #: The queues carried by NATS JetStream, if any.
    streams: list[stats.StreamStats] = field(default_factory=list)
    load: QueueLoad | None = None  # the queue's share of the database's active time
    #: Sessions holding or queued for a lock on the job table that stops the workers.
    locks: list[dbstats.TableLock] = field(default_factory=list)
    #: How each queue yields to the application.
    yielding: list[stats.QueueYield] = field(default_factory=list)
    #: The limited tasks' jobs waiting and running.
    limits: list[stats.LimitUse] = field(default_factory=list)
    #: The batches not yet succeeded, and the jobs waiting for others (after=).
    batches: stats.BatchStats = field(default_factory=stats.BatchStats)
    #: The live and failed jobs by queue and task, which `queues` adds up by queue.
    depths: list[stats.Depth] = field(default_factory=list)

    def yielding_of(self, queue: str) -> stats.QueueYield | None:
        return next((y for y in self.yielding if y.queue == queue), None)

    def activity_of(self, queue: str, window: int) -> stats.QueueActivity | None:
        return next((a for a in self.activity if a.queue == queue and a.window == window), None)

    def serving(self, queue: str) -> list[str]:
        """The live workers that take jobs from `queue`."""
        return [w.worker for w in self.workers if w.alive and queue in w.queues]

    @property
    def alive(self) -> list[stats.WorkerStats]:
        return [w for w in self.workers if w.alive]

    @property
    def silent(self) -> list[stats.WorkerStats]:
        """Workers that wrote a row in the last 15 minutes, then went silent without stopping
        (killed, hung, or cut off from the database)."""
        return [w for w in self.workers if not w.alive and not w.stopped]

    @property
    def stopped(self) -> list[stats.WorkerStats]:
        """Workers that stopped (and said so) in the last 15 minutes."""
        return [w for w in self.workers if w.stopped]


#: The longest the report waits for a lock, in seconds (PGJOBS["HEALTH"]["REPORT_LOCK_SECONDS"]):
#: only an ACCESS EXCLUSIVE lock holds its reads back, which the report says rather than wait.
REPORT_LOCK_SECONDS = 1.0
#: The longest any one of its statements runs (PGJOBS["HEALTH"]["REPORT_STATEMENT_SECONDS"]).
REPORT_STATEMENT_SECONDS = 5.0


def measure(db: str | None = None) -> Figures:
    """Take the figures: a dozen cheap queries, none of which scans the finished history, in
    one `limited` transaction (the DatabaseError of one that ran out of time propagates)."""
    db = stats.job_database(db)
    with limited(db):
        # Before the job table is read: this answers even while the table is locked.
        locks = dbstats.table_locks(db)
        with connections[db].cursor() as cursor:
            cursor.execute("SELECT now()")
            (now,) = cursor.fetchone()
        activity, workers = stats.activity_stats(db), stats.worker_stats(db)
        yielding, limits = stats.yield_stats(db), stats.limit_stats(db)
        batches = stats.batch_stats(db)
        seen = {a.queue for a in activity} | {queue for w in workers for queue in w.queues}
        depths = stats.depths(db)
        queues = stats.queue_depths(db, also=seen, found=depths)
        table, database = dbstats.table_stats(db), dbstats.database_stats(db)
        load = queue_load(db)
    return Figures(
        at=now,
        queues=queues,
        activity=activity,
        workers=workers,
        table=table,
        database=database,
        streams=stream_stats(now),  # a network call to NATS: outside the transaction
        load=load,
        locks=locks,
        yielding=yielding,
        limits=limits,
        batches=batches,
        depths=depths,
    )


@contextmanager
def limited(db: str) -> Iterator[None]:
    """A transaction on `db` whose statements wait at most REPORT_LOCK_SECONDS for a lock and run at
    most REPORT_STATEMENT_SECONDS (report_limits), or less where the session asks for less. SET
    LOCAL, so a pooled connection keeps none of them; nested in a caller's transaction, they are put
    back when the block ends."""
    nested = connections[db].in_atomic_block
    with transaction.atomic(using=db), connections[db].cursor() as cursor:
        cursor.execute(_LIMIT, [milliseconds(limit) for limit in report_limits()])
        before = [(name, old) for name, old, _new in cursor.fetchall()]
        yield
        # Only reached without an error; after one, the rollback put them back.
        if nested:
            cursor.execute(_RESTORE, [[name for name, _ in before], [old for _, old in before]])


def report_limits() -> tuple[float, float]:
    """The report's lock and statement time limits: PGJOBS["HEALTH"] over the defaults above."""
    overrides = get_settings().HEALTH
    return (
        float(overrides.get("REPORT_LOCK_SECONDS", REPORT_LOCK_SECONDS)),
        float(overrides.get("REPORT_STATEMENT_SECONDS", REPORT_STATEMENT_SECONDS)),
    )


def milliseconds(seconds: float) -> int:
    """A PostgreSQL timeout setting for `seconds`: 0 (none) for 0 and for more than it takes
    (about 24 days, infinity included); at least 1 ms for any other."""
    if seconds <= 0 or seconds * 1000 >= _TIMEOUT_MAX_MS:
        return 0
    return max(1, round(seconds * 1000))


_TIMEOUT_MAX_MS = 2**31 - 1

# A limit already lower (a role's `ALTER ROLE monitor SET statement_timeout = '2s'`) is kept,
# whichever of the two is none (0): least() ignores the NULL that stands for it.
_LIMIT = """
    SELECT s.name, s.setting,
           set_config(s.name,
                      coalesce(least(nullif(s.setting::bigint, 0), nullif(v.ms, 0)), 0)::text,
                      true)
    FROM pg_settings s
    JOIN (VALUES ('lock_timeout', %s::bigint), ('statement_timeout', %s::bigint)) AS v(name, ms)
      ON v.name = s.name
"""
_RESTORE = """
    SELECT set_config(name, setting, true) FROM unnest(%s::text[], %s::text[]) AS t(name, setting)
"""


def no_streams(now: datetime) -> list[stats.StreamStats]:
    """No queue is carried by NATS."""
    return []


#: The figures of the queues carried by NATS (`now`: the database's clock), set by apps.py, so
#: that observability never imports jetstream/ (nor nats).
stream_stats: Callable[[datetime], list[stats.StreamStats]] = no_streams
