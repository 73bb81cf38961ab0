"""Read-only measurements an operator needs to tell whether the queue is healthy.

Queue depth and age, retries waiting, dead letters, and the table's own health: live and dead
tuples, autovacuum, size, connections, and the oldest snapshot holding back vacuum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db import connections, router


@dataclass(frozen=True)
class QueueStats:
    queue: str
    due: int  # ready and run_at <= now()
    scheduled: int  # ready, run_at in the future (including retries waiting out their backoff)
    retrying: int  # ready after at least one failed attempt
    running: int
    failed: int
    oldest_due_seconds: float  # how long the oldest due job has waited: the latency to watch


@dataclass(frozen=True)
class TableStats:
    live_tuples: int
    dead_tuples: int
    table_bytes: int
    index_bytes: int
    last_autovacuum: datetime | None
    last_autoanalyze: datetime | None
    autovacuum_count: int
    connections: dict[str, int]  # this database's connections by state
    oldest_snapshot_seconds: float  # age of the oldest transaction snapshot: vacuum's horizon
    oldest_snapshot_query: str


def _db(db: str | None) -> str:
    from django_pgjobs.models import Job

    return db or router.db_for_write(Job)


def queue_stats(db: str | None = None) -> list[QueueStats]:
    with connections[_db(db)].cursor() as cursor:
        cursor.execute(
            """
            SELECT queue,
                   count(*) FILTER (WHERE status = 'ready' AND run_at <= now()),
                   count(*) FILTER (WHERE status = 'ready' AND run_at > now()),
                   count(*) FILTER (WHERE status = 'ready' AND attempts > 0),
                   count(*) FILTER (WHERE status = 'running'),
                   count(*) FILTER (WHERE status = 'failed'),
                   COALESCE(EXTRACT(EPOCH FROM now() - min(run_at)
                            FILTER (WHERE status = 'ready' AND run_at <= now())), 0)
            FROM pgjobs_job
            WHERE status IN ('ready', 'running', 'failed')
            GROUP BY queue ORDER BY queue
            """
        )
        return [
            QueueStats(queue, due, scheduled, retrying, running, failed, float(oldest))
            for queue, due, scheduled, retrying, running, failed, oldest in cursor.fetchall()
        ]


def table_stats(db: str | None = None) -> TableStats:
    with connections[_db(db)].cursor() as cursor:
        cursor.execute(
            """
            SELECT n_live_tup, n_dead_tup, pg_table_size(relid), pg_indexes_size(relid),
                   last_autovacuum, last_autoanalyze, autovacuum_count
            FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'
            """
        )
        live, dead, heap, indexes, vacuumed, analyzed, vacuums = cursor.fetchone() or (
            0, 0, 0, 0, None, None, 0,
        )  # fmt: skip
        cursor.execute(
            "SELECT COALESCE(state, 'unknown'), count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() GROUP BY 1"
        )
        by_state = {state: count for state, count in cursor.fetchall()}
        cursor.execute(
            """
            SELECT COALESCE(EXTRACT(EPOCH FROM now() - xact_start), 0), left(query, 200)
            FROM pg_stat_activity
            WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
              AND datname = current_database()  -- only they hold back vacuum of this table
            ORDER BY age(backend_xmin) DESC LIMIT 1
            """
        )
        oldest = cursor.fetchone() or (0, "")
    return TableStats(
        live,
        dead,
        heap,
        indexes,
        vacuumed,
        analyzed,
        vacuums,
        by_state,
        float(oldest[0]),
        oldest[1],
    )


def as_dict(db: str | None = None) -> dict[str, Any]:
    return {
        "queues": [asdict(stats) for stats in queue_stats(db)],
        "table": asdict(table_stats(db)),
    }
