"""The queue's share of the database's active time: how much of PostgreSQL's work is the queue's.

From pg_stat_statements (1.9 or later) when it is installed in the job database: execution time
of statements naming the queue's tables against all statements'. Otherwise by sampling
pg_stat_activity for a moment: active backends running such a statement, or named as a worker
(application_name), against all active ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections

from django_pgjobs.observability.stats import job_database

#: pg_stat_activity samples taken, and the pause between them, without pg_stat_statements: the
#: report (and the dashboard) waits for them.
SAMPLES, SAMPLE_INTERVAL = 10, 0.005
#: Samples that must see an active backend before a share is judged: one statement of an idle
#: worker's poll, caught alone, is not "the queue takes the database".
BUSY_SAMPLES = 3

#: What the queue's statements name (its tables), and what its workers call their connections.
QUEUE_STATEMENT = "pgjobs\\_"
WORKER_APPLICATION = "pgjobs worker"

_LOADED = """
    SELECT to_regclass('pg_stat_statements_info') IS NOT NULL  -- version 1.9 (PostgreSQL 14)
       AND current_setting('shared_preload_libraries') LIKE '%%pg_stat_statements%%'
"""

_STATEMENTS = """
    SELECT COALESCE(sum(total_exec_time) FILTER (WHERE query LIKE %(queue)s), 0),
           COALESCE(sum(total_exec_time), 0),
           (SELECT stats_reset FROM pg_stat_statements_info)
    FROM pg_stat_statements
    WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

_ACTIVITY = """
    SELECT count(*) FILTER (WHERE application_name LIKE %(worker)s OR query LIKE %(queue)s),
           count(*)
    FROM pg_stat_activity
    WHERE state = 'active' AND datname = current_database()
      AND backend_type = 'client backend' AND pid <> pg_backend_pid()
"""


@dataclass(frozen=True)
class QueueLoad:
    """The queue's share (0 to 1) of the database's active time; None when nothing ran."""

    share: float | None
    source: str  # "pg_stat_statements" or "pg_stat_activity"
    since: datetime | None = None  # pg_stat_statements: its last reset
    samples: int = 0  # pg_stat_activity: how many samples saw an active backend

    def describe(self) -> str:
        if self.share is None and self.samples:
            return (
                f"too little activity to tell ({self.source}: {self.samples} of {SAMPLES} "
                f"samples over {SAMPLES * SAMPLE_INTERVAL:g}s saw one active)"
            )
        if self.share is None:
            return f"no statement was active ({self.source})"
        if self.source == "pg_stat_statements":
            since = f"since {self.since:%Y-%m-%d %H:%M:%S %Z}" if self.since else "since its reset"
            return f"{self.share:.0%} of the statements' execution time ({self.source}, {since})"
        return (
            f"{self.share:.0%} of the active backends ({self.source}, {self.samples} of "
            f"{SAMPLES} samples over {SAMPLES * SAMPLE_INTERVAL:g}s saw one active)"
        )


def queue_load(db: str | None = None) -> QueueLoad:
    """The queue's share of the job database's active time (see the module's docstring)."""
    params = {"queue": f"%{QUEUE_STATEMENT}%", "worker": f"{WORKER_APPLICATION}%"}
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(_LOADED)
        (loaded,) = cursor.fetchone()
        if loaded:
            cursor.execute(_STATEMENTS, params)
            queue, total, since = cursor.fetchone()
            share = float(queue) / float(total) if total else None
            return QueueLoad(share, "pg_stat_statements", since=since)
        queue_seen = active_seen = samples = 0
        for n in range(SAMPLES):
            # The pause on the server; a new snapshot of the statistics for each sample.
            cursor.execute(
                "SELECT pg_sleep(%s), pg_stat_clear_snapshot()", [SAMPLE_INTERVAL * bool(n)]
            )
            cursor.execute(_ACTIVITY, params)
            queue, active = cursor.fetchone()
            queue_seen, active_seen = queue_seen + queue, active_seen + active
            samples += bool(active)
    share = queue_seen / active_seen if samples >= BUSY_SAMPLES else None
    return QueueLoad(share, "pg_stat_activity", samples=samples)
