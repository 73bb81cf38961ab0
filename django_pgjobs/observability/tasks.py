"""Per-task figures, as the dashboard shows them: each task's jobs now by state (the report's
depths added up by task), and its runs over the last hour and day from the workers' statistics
rolled up per task (Rollup rows of kind "task"): how many, how many failed, how long they took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from django.db import connections

from django_pgjobs.models import DURATION_BUCKETS
from django_pgjobs.observability import stats

#: (seconds, the Rollup rows' step): the last hour by minute, the last day by hour.
WINDOWS = ((3600, 60), (86400, 3600))

# A task's rows of one window, through the rollup's unique index.
RUNS_SQL = """
    SELECT name, succeeded, retried, failed, durations
    FROM pgjobs_rollup
    WHERE kind = 'task' AND step = %(step)s
      AND at > now() - make_interval(secs => %(seconds)s) AND at <= statement_timestamp()
"""


@dataclass
class Runs:
    """A task's runs over a window: how they ended, and how long they took (a histogram over
    DURATION_BUCKETS)."""

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    durations: list[int] = field(default_factory=list)

    @property
    def runs(self) -> int:
        return self.succeeded + self.retried + self.failed

    @property
    def failure_rate(self) -> float | None:
        """The share of runs that raised (retried, or dead-lettered); None: no run."""
        return (self.retried + self.failed) / self.runs if self.runs else None

    def duration(self, quantile: float) -> float | None:
        return stats.quantile(self.durations, quantile, DURATION_BUCKETS)

    @property
    def duration_p50(self) -> float | None:
        return self.duration(0.5)

    @property
    def duration_p95(self) -> float | None:
        return self.duration(0.95)

    def add(self, succeeded: int, retried: int, failed: int, durations: list[int]) -> None:
        self.succeeded += succeeded
        self.retried += retried
        self.failed += failed
        self.durations = [a + b for a, b in zip_longest(self.durations, durations, fillvalue=0)]


@dataclass
class TaskFigures:
    """A task's jobs now, by state, and its runs over the last hour and day."""

    task: str
    now: dict[str, int | float]  # as stats.added_up: due, scheduled, running, expired, failed…
    hour: Runs = field(default_factory=Runs)
    day: Runs = field(default_factory=Runs)


def task_figures(depths: list[stats.Depth], db: str | None = None) -> list[TaskFigures]:
    """Every task with live or failed jobs, or runs in the last day, by name."""
    by_task: dict[str, list[stats.Depth]] = {}
    for row in depths:
        by_task.setdefault(row.task, []).append(row)
    runs: dict[tuple[str, int], Runs] = {}
    with connections[stats.job_database(db)].cursor() as cursor:
        for seconds, step in WINDOWS:
            cursor.execute(RUNS_SQL, {"step": step, "seconds": seconds})
            for task, succeeded, retried, failed, durations in cursor.fetchall():
                runs.setdefault((task, seconds), Runs()).add(
                    int(succeeded), int(retried), int(failed), list(durations)
                )
    names = sorted(by_task.keys() | {task for task, _ in runs})
    return [
        TaskFigures(
            name,
            stats.added_up(by_task.get(name, [])),
            runs.get((name, 3600), Runs()),
            runs.get((name, 86400), Runs()),
        )
        for name in names
    ]


def as_dict(figures: TaskFigures) -> dict[str, Any]:
    """A task's figures as JSON-ready data."""
    return {
        "task": figures.task,
        **figures.now,
        **{
            window: {
                "runs": runs.runs,
                "failure_rate": runs.failure_rate,
                "p50_seconds": runs.duration_p50,
                "p95_seconds": runs.duration_p95,
            }
            for window, runs in (("hour", figures.hour), ("day", figures.day))
        },
    }
