"""The PGJOBS settings dict, every key optional, with its defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import cache
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULT_RETENTION = timedelta(hours=1)


@dataclass(frozen=True)
class Settings:
    DEFAULT_QUEUE: str = "default"
    DEFAULT_PRIORITY: int = 0
    MAX_ATTEMPTS: int = 5
    #: Seconds a claim holds a job before another worker may take it back.
    LEASE: float = 30.0
    #: Seconds one attempt may run, for tasks without a timeout= of their own; None: no limit.
    TIMEOUT: float | None = None
    #: Backoff before retry n: a random delay in [0, min(BACKOFF_MAX, BACKOFF_BASE * 2**(n-1))].
    BACKOFF_BASE: float = 2.0
    BACKOFF_MAX: float = 3600.0
    #: Largest accepted payload, in bytes of JSON.
    MAX_PAYLOAD_BYTES: int = 1_000_000
    #: How many attempts' errors a job keeps in its history.
    ERRORS_KEPT: int = 5
    #: Whether the worker's own transactions wait for their WAL flush. False: a crash of
    #: PostgreSQL may undo their last fraction of a second (docs/explanation/guarantees.md).
    WORKER_SYNCHRONOUS_COMMIT: bool = False
    #: Wake idle workers with a NOTIFY that an enqueue's INSERT sends (delivered at commit).
    NOTIFY: bool = True
    #: How long finished jobs stay before they are pruned (see retention()).
    RETENTION: timedelta | Mapping[str, timedelta | None] = DEFAULT_RETENTION
    #: Rows deleted per prune statement.
    PRUNE_BATCH: int = 1000
    #: How long the workers' per-queue statistics (QueueStat rows) are kept.
    STATS_RETENTION: timedelta = timedelta(days=1)
    #: Periodic schedules by name: {"name": {"task": ..., "cron": ..., ...}} (see periodic.py).
    PERIODIC: Mapping[str, Any] = field(default_factory=dict)
    #: Thresholds of the health verdict, over health.Thresholds' defaults.
    HEALTH: Mapping[str, float] = field(default_factory=dict)
    #: Trace enqueues and runs with OpenTelemetry (tracing.py; the `otel` extra).
    TRACING: bool = False
    #: Per-queue settings by queue name, e.g. {"events": {"TRANSPORT": "nats"}} (transports.py).
    QUEUES: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: The NATS servers of queues whose transport is "nats" (transports.py).
    NATS: Mapping[str, Any] = field(default_factory=dict)
    #: How much longer the application's transactions may stay open, on average and as a
    #: multiple of how long they do while the queue holds back, before workers claim fewer jobs
    #: (docs/explanation/yielding.md); None: never yield. A queue's own:
    #: QUEUES[name]["YIELD_BUDGET"].
    YIELD_BUDGET: float | None = 1.15
    #: Jobs a second each worker still claims from each queue, however much it yields.
    YIELD_FLOOR: float = 10.0

    def yield_budget(self, queue: str) -> float | None:
        """The budget `queue` yields with (None: it never yields)."""
        entry = self.QUEUES.get(queue) or {}
        budget: float | None = entry.get("YIELD_BUDGET", self.YIELD_BUDGET)
        return budget

    def retention(self) -> dict[str, timedelta | None]:
        """How long jobs of each final status are kept; None keeps them until deleted by hand.

        RETENTION as a timedelta applies to succeeded and cancelled jobs; as a dict it names
        statuses, the others keeping their default (failed: forever, dead letters wait for a
        person)."""
        default = DEFAULT_RETENTION
        if isinstance(self.RETENTION, timedelta):
            return {"succeeded": self.RETENTION, "cancelled": self.RETENTION, "failed": None}
        return {"succeeded": default, "cancelled": default, "failed": None, **self.RETENTION}


DEFAULTS = Settings()
_NAMES = {field.name for field in fields(Settings)}


@cache
def get_settings() -> Settings:
    """The current settings: PGJOBS over the defaults."""
    overrides: dict[str, Any] = getattr(django_settings, "PGJOBS", {})
    return Settings(**{key: value for key, value in overrides.items() if key in _NAMES})


def budget_problems(where: str, value: Any) -> list[str]:
    """What is wrong with a yield budget: a number above 1 (how many times longer the
    application's transactions may stay open), or None (never yield)."""
    if value is None or (
        not isinstance(value, bool) and isinstance(value, int | float) and 1 < value <= 1000
    ):
        return []
    return [
        f"{where} must be a number above 1 and at most 1000 (1.15: the application's "
        f"transactions may stay open 15% longer than usual), or None to never yield, "
        f"not {value!r}."
    ]


def unknown_keys() -> list[str]:
    return sorted(set(getattr(django_settings, "PGJOBS", {})) - _NAMES)


@receiver(setting_changed)
def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting == "PGJOBS":
        get_settings.cache_clear()
