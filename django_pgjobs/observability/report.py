"""The health report: every figure of stats and dbstats at one moment, and the verdict on them.
`jobstats`, the admin's report page and the Prometheus collector all show this one report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from django.db import connections

from django_pgjobs.observability import dbstats, health, stats


@dataclass(frozen=True)
class Report:
    at: datetime  # the database's clock when the report was taken
    queues: list[stats.QueueStats]
    activity: list[stats.Activity]
    workers: list[stats.WorkerStats]
    table: dbstats.TableStats
    database: dbstats.DatabaseStats
    verdict: health.Verdict = field(default_factory=lambda: health.Verdict([]))

    def activity_of(self, queue: str, window: int) -> stats.Activity | None:
        return next((a for a in self.activity if a.queue == queue and a.window == window), None)

    def serving(self, queue: str) -> list[str]:
        """The live workers that take jobs from `queue`."""
        return [w.worker for w in self.workers if w.alive and queue in w.queues]


def collect(db: str | None = None, previous: Report | None = None) -> Report:
    """Take the report (a dozen cheap queries) and judge it; `previous` is the last sample of a
    --watch, which lets the verdict say how a backlog moved."""
    db = stats.job_database(db)
    with connections[db].cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    activity, workers = stats.activity_stats(db), stats.worker_stats(db)
    seen = {a.queue for a in activity} | {queue for w in workers for queue in w.queues}
    report = Report(
        at=now,
        queues=stats.queue_stats(db, also=seen),
        activity=activity,
        workers=workers,
        table=dbstats.table_stats(db),
        database=dbstats.database_stats(db),
    )
    return replace(report, verdict=health.judge(report, previous))


def as_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON-ready data (datetimes left for the caller's encoder)."""
    queues = []
    for q in report.queues:
        windows = {}
        for window in stats.WINDOWS:
            a = report.activity_of(q.queue, window)
            windows[f"{window}s"] = None if a is None else {
                "claimed": a.claimed,
                "succeeded": a.succeeded,
                "retried": a.retried,
                "failed": a.failed,
                "throughput": a.throughput,
                "retry_rate": a.retry_rate,
                "latency_p50": a.latency(0.5),
                "latency_p95": a.latency(0.95),
            }  # fmt: skip
        queues.append({**asdict(q), "workers": len(report.serving(q.queue)), "windows": windows})
    return {
        "at": report.at,
        "status": report.verdict.status,
        "reasons": [reason.as_dict() for reason in report.verdict.reasons],
        "queues": queues,
        "workers": [asdict(worker) for worker in report.workers],
        "table": asdict(report.table),
        "database": {
            **asdict(report.database),
            "connections_ratio": report.database.connections_ratio,
        },
    }
