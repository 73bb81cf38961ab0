"""Backoff with full jitter, and which errors are worth another attempt."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import OperationalError

from django_pgjobs.delays import as_seconds
from django_pgjobs.errors import PayloadMismatch, PermanentError

#: Errors that another attempt cannot fix, whatever the task says.
PERMANENT: tuple[type[BaseException], ...] = (
    PermanentError,
    PayloadMismatch,
    ObjectDoesNotExist,
    ValidationError,
)


@dataclass(frozen=True)
class ExponentialBackoff:
    """Full jitter: a random delay in [0, min(cap, base * 2**(attempts - 1))] seconds.

    Spreading retries over the whole window keeps a failing dependency from being hit by every
    job at the same moment when it recovers.
    """

    base: float = 2.0
    cap: float = 3600.0

    def ceiling(self, attempts: int) -> float:
        return min(self.cap, self.base * 2.0 ** min(max(attempts - 1, 0), 62))

    def __call__(self, attempts: int) -> float:
        return random.uniform(0, self.ceiling(attempts))


def is_permanent(
    error: BaseException, task_permanent: tuple[type[BaseException], ...] = ()
) -> bool:
    """True when retrying cannot help: our PERMANENT list or the task's own permanent_errors.

    Everything else is transient, including database connection, serialization-failure and
    deadlock errors (``OperationalError`` and its psycopg causes) raised by the handler.
    """
    if isinstance(error, OperationalError):
        return False
    return isinstance(error, PERMANENT + task_permanent)


def backoff_seconds(backoff: Callable[[int], object], attempts: int, task: str) -> float:
    """What a task's `backoff` says to wait after `attempts` attempts, in seconds; ValueError
    (or whatever the backoff raised) naming the task when it does not say a usable delay."""
    return as_seconds(backoff(attempts), f"the backoff of {task}")
