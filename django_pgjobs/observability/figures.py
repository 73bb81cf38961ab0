"""Every figure of stats and dbstats at one moment: what the health verdict judges.

Kept apart from the report so that the verdict (health) can read the figures while the report
(report) holds the verdict: figures ← health ← report, with no cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections

from django_pgjobs import transports
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


def measure(db: str | None = None) -> Figures:
    """Take the figures: a dozen cheap queries, none of which scans the finished history."""
    db = stats.job_database(db)
    with connections[db].cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    activity, workers = stats.activity_stats(db), stats.worker_stats(db)
    seen = {a.queue for a in activity} | {queue for w in workers for queue in w.queues}
    return Figures(
        at=now,
        queues=stats.queue_depths(db, also=seen),
        activity=activity,
        workers=workers,
        table=dbstats.table_stats(db),
        database=dbstats.database_stats(db),
        streams=stream_stats(),
        load=queue_load(db),
    )


def stream_stats() -> list[stats.StreamStats]:
    """The figures of the queues carried by NATS, asked of the server; none without such queues
    (and then nats is never imported)."""
    queues = transports.nats_queues()
    if not queues:
        return []
    from django_pgjobs.jetstream.figures import measure  # needs nats-py: only when used

    return measure(queues)
