"""The health report: the figures at one moment and the verdict on them.

`jobstats`, the admin's report page and the Prometheus collector all show this one report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError

from django_pgjobs import schema
from django_pgjobs.data import rows
from django_pgjobs.errors import first_line
from django_pgjobs.observability import dbstats, health
from django_pgjobs.observability.figures import Figures, limited, measure
from django_pgjobs.observability.stats import WINDOWS, QueueActivity, job_database, window_label


@dataclass(frozen=True)
class Report(Figures):
    """The figures (queues, activity, workers, table, database, taken `at` the database's
    clock) and the verdict on them."""

    verdict: health.Verdict = field(default_factory=lambda: health.Verdict([]))


def collect(db: str | None = None, previous: Report | None = None) -> Report:
    """Take the report (a dozen cheap queries) and judge it; `previous` is the last sample of a
    --watch, which lets the verdict say how a backlog moved."""
    figures = measure(db)
    return Report(**vars(figures), verdict=health.judge(figures, previous))


def locked_out(db: str | None = None) -> health.Reason | None:
    """After the report ran out of time: the job table is locked, by whom and for how long;
    None when it is not, or when that cannot be told either (the caller says what failed)."""
    try:
        with limited(job_database(db)):
            return health.locked(dbstats.table_locks(db), waited=True)
    except DatabaseError:
        return None


def activity_figures(activity: QueueActivity) -> dict[str, Any]:
    """What the report shows of a queue's activity over one window."""
    return {
        "claimed": activity.claimed,
        "succeeded": activity.succeeded,
        "retried": activity.retried,
        "failed": activity.failed,
        "throughput": activity.throughput,
        "retry_rate": activity.retry_rate,
        "latency_p50": activity.latency(0.5),
        "latency_p95": activity.latency(0.95),
    }


def as_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON-ready data (datetimes left for the caller's encoder)."""
    queues = []
    for q in report.queues:
        windows = {}
        for window in WINDOWS:
            a = report.activity_of(q.queue, window)
            windows[f"{window}s"] = None if a is None else activity_figures(a)
        queues.append({**fields_of(q), "workers": len(report.serving(q.queue)), "windows": windows})
    return {
        "at": report.at,
        "status": report.verdict.status,
        "reasons": [reason.as_dict() for reason in report.verdict.reasons],
        "queues": queues,
        "workers": [fields_of(worker) for worker in report.workers],
        "table": fields_of(report.table),
        "database": {
            **fields_of(report.database),
            "connections_ratio": report.database.connections_ratio,
        },
        "streams": [fields_of(stream) for stream in report.streams],
        "load": None if report.load is None else fields_of(report.load),
        "locks": [fields_of(lock) for lock in report.locks],
        "yielding": [fields_of(y) for y in report.yielding],
        "limits": [fields_of(use) for use in report.limits],
        "batches": {
            "open": report.batches.open,
            "completed_not_succeeded": report.batches.completed_not_succeeded,
        }
        if report.batches.readable
        else None,
        "waiting": report.batches.waiting,
    }


def fields_of(figures: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, its lists and dicts shared, not copied as asdict would:
    a hundred workers' queue lists are copied in no time that way, and nothing changes them."""
    return dict(vars(figures))


def activity_rows(report: Report) -> list[dict[str, Any]]:
    """One row per queue and window with its activity, as the report page's table lists it."""
    return [
        {"queue": a.queue, "window": window_label(a.window), **activity_figures(a)}
        for a in report.activity
    ]


#: SQLSTATE of a statement refused for lack of a privilege.
INSUFFICIENT_PRIVILEGE = "42501"


@dataclass(frozen=True)
class NoReport:
    """A sample that could not be taken: its level and why, in one line; with the reason when
    there is one (the job table locked)."""

    level: health.Level
    why: str
    reason: health.Reason | None = None
    #: For machines (pgjobs_health_reason): the reason's code, or what kept the report away.
    code: str = "report_failed"


def no_report(error: DatabaseError, db: str | None = None) -> NoReport:
    """Why the report could not be taken, and how bad that is: critical without the database
    or its tables, or while the job table is locked against the workers; else unknown."""
    first = first_line(error)
    alias = job_database(db)
    if schema.is_not_migrated(error):
        return NoReport(
            health.Level.CRITICAL,
            f"{schema.explained(error)} on the database {alias!r}",
            code="tables_not_migrated",
        )
    # A timeout, a cancel request, a rollback: the report's failure, not the database's.
    if rows.timed_out(error) or rows.rolled_back(error):
        return out_of_time(first, db)
    if getattr(error.__cause__, "sqlstate", None) == INSUFFICIENT_PRIVILEGE:
        return NoReport(
            health.Level.UNKNOWN,
            f"the report could not be read ({first}): the database user needs SELECT on the "
            "pgjobs tables, and the pg_monitor role to read PostgreSQL's statistics",
            code="report_not_allowed",
        )
    # Connections refused or lost, and servers shutting down, are OperationalErrors.
    if isinstance(error, OperationalError | InterfaceError):
        return NoReport(
            health.Level.CRITICAL,
            f"the database {alias!r} cannot be used: {first}",
            code="database_unusable",
        )
    return NoReport(health.Level.UNKNOWN, f"the report could not be taken: {first}")


def out_of_time(first: str, db: str | None = None) -> NoReport:
    """A statement of the report ran out of time, was cancelled or rolled back: the job table
    locked against the workers if it is (its own verdict), else unknown."""
    reason = locked_out(db)
    if reason is not None:
        return NoReport(reason.level, f"{reason.summary}: {reason.detail}", reason, reason.code)
    return NoReport(
        health.Level.UNKNOWN,
        f"the report could not be taken ({first}); the database answers, but a statement of "
        "the report ran out of time, was cancelled or was rolled back (PGJOBS['HEALTH']'s "
        "REPORT_STATEMENT_SECONDS and REPORT_LOCK_SECONDS set how long it may take)",
        code="report_out_of_time",
    )
