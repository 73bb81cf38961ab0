"""Cron expressions: checking one, and its next tick in a time zone."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from croniter import CroniterError, croniter

CRON_HINT = (
    "Use five fields (minute hour day-of-month month day-of-week), e.g. '0 3 * * *', or six "
    "with seconds last, e.g. '* * * * * */10'."
)


def check_cron(cron: Any, where: str) -> str:
    """The cron expression, or ValueError saying what is wrong with it."""
    if not isinstance(cron, str):
        raise ValueError(f"{where} must be a cron expression (a string), got {cron!r}. {CRON_HINT}")
    try:
        croniter.expand(cron, strict=True)
        croniter(cron, datetime.now(UTC)).get_next(datetime)
    except CroniterError as error:
        raise ValueError(
            f"{where}: {cron!r} is not a valid cron expression ({error}). {CRON_HINT}"
        ) from None
    return cron


def next_tick(cron: str, zone: ZoneInfo, after: datetime) -> datetime:
    """The first tick of `cron` (read on `zone`'s wall clock) strictly after `after`, in UTC:
    Python compares times of one zone by wall clock, so an autumn night's two 02:30s are equal."""
    tick: datetime = croniter(cron, after.astimezone(zone)).get_next(datetime)
    return tick.astimezone(UTC)
