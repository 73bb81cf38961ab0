"""Delays as seconds that PostgreSQL can add to its clock: what Retry, enqueue's `delay` and a
task's `backoff=` may say."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

#: The longest delay accepted: now + delay must stay a time PostgreSQL and Python can hold.
MAX_DELAY = timedelta(days=365 * 1000)


def as_seconds(value: Any, what: str) -> float:
    """`value` (seconds, or a timedelta) as seconds; ValueError naming `what` unless it is a
    finite number from 0 to MAX_DELAY."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(
            f"{what} must be seconds (a number) or a timedelta, got {type(value).__name__} "
            f"{_short(value)}."
        )
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DELAY.total_seconds():
        raise ValueError(
            f"{what} must be zero or more seconds (finite, non-negative, at most "
            f"{MAX_DELAY.total_seconds():.0f}: {MAX_DELAY.days // 365} years), got {_short(value)}."
        )
    return float(seconds)


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:79] + "…"
