"""Backoff with full jitter, and which errors are worth another attempt."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import OperationalError

from django_pgjobs.delays import as_seconds
from django_pgjobs.errors import PayloadMismatch, PermanentError, text_of

#: Errors that another attempt cannot fix, whatever the task says.
PERMANENT: tuple[type[BaseException], ...] = (
    PermanentError,
    PayloadMismatch,
    ObjectDoesNotExist,
    ValidationError,
)


@dataclass(frozen=True)
class ExponentialBackoff:
    """Full jitter: a random delay in [0, min(cap, base * 2**(attempts - 1))] seconds, so that
    a dependency that recovers is not hit by every job at the same moment."""

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
    Everything else is transient, ``OperationalError`` (connections, deadlocks) included."""
    if isinstance(error, OperationalError):
        return False
    return isinstance(error, PERMANENT + task_permanent)


#: How long a worker's main thread waits for a task's backoff (when reaping) before it gives
#: up: that thread heartbeats every job, so it must not hang on a task's code.
BACKOFF_PATIENCE = 1.0

_lock = threading.Lock()
#: Tasks whose backoff was called with a limit and has not returned yet.
_unreturned: set[str] = set()


def backoff_seconds(
    backoff: Callable[[int], object], attempts: int, task: str, *, within: float | None = None
) -> float:
    """What a task's `backoff` says to wait after `attempts` attempts, in seconds; ValueError
    for an unusable value, RuntimeError for what it raised (SystemExit included), each naming
    the task. With `within`, it runs on a thread of its own and TimeoutError is raised past that
    many seconds (at once while an earlier call hangs, so it holds at most one thread)."""
    what = f"the backoff of {task}"
    if within is None:
        try:
            delay = backoff(attempts)
        except BaseException as error:
            raise _raised(what, error) from error
        return as_seconds(delay, what)
    with _lock:
        if task in _unreturned:
            raise TimeoutError(f"{what} has not returned from an earlier call")
        _unreturned.add(task)
    ended = threading.Event()
    result: list[object] = []
    raised: list[BaseException] = []

    def call() -> None:
        try:
            result.append(backoff(attempts))
        except BaseException as error:  # handed to the caller, SystemExit included
            raised.append(error)
        finally:
            with _lock:
                _unreturned.discard(task)
            ended.set()

    threading.Thread(target=call, name=f"pgjobs backoff of {task}", daemon=True).start()
    if not ended.wait(within):
        raise TimeoutError(f"{what} did not return within {within:.2g}s")
    if raised:
        raise _raised(what, raised[0]) from raised[0]
    return as_seconds(result[0], what)


def _raised(what: str, error: BaseException) -> RuntimeError:
    text = text_of(error)
    return RuntimeError(f"{what} raised {type(error).__qualname__}" + (f": {text}" if text else ""))
