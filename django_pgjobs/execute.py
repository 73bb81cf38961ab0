"""Running one claimed job: find its task in the registry, call it, and classify the outcome."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync

from django_pgjobs import registry
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import PayloadMismatch, Retry, UnknownTask
from django_pgjobs.manager import Failure
from django_pgjobs.retry import ExponentialBackoff, is_permanent

if TYPE_CHECKING:
    from django_pgjobs.models import Job


class Result(Enum):
    SUCCEEDED = "succeeded"
    RETRY = "retry"  # the handler raised Retry: run again later, not an error
    ERROR = "error"


@dataclass(frozen=True)
class Outcome:
    result: Result
    delay: float = 0.0
    failure: Failure | None = None
    permanent: bool = False
    #: The handler's wall time in seconds.
    duration: float = 0.0
    #: The return value as JSON text, for a task that keeps its result; None keeps nothing.
    result_json: str | None = None


SUCCEEDED = Outcome(Result.SUCCEEDED)

_current_job: ContextVar[Job | None] = ContextVar("pgjobs_current_job", default=None)


def current_job() -> Job | None:
    """The job whose handler is running in this thread (or task), else None.

    Its ``id``, ``attempts`` and ``worker`` identify this attempt, e.g. for idempotency keys.
    """
    return _current_job.get()


def run(job: Job) -> Outcome:
    """Call the job's registered handler with its payload as keyword arguments. Never raises:
    whatever the handler raises, SystemExit and KeyboardInterrupt included, becomes an Outcome."""
    try:
        task = registry.get_task(job.task)
    except UnknownTask as error:
        # Never import by name from table data: an unknown task is a dead letter.
        return Outcome(Result.ERROR, failure=_failure(error, with_traceback=False), permanent=True)
    try:
        _check_arguments(task, job.payload)
    except PayloadMismatch as error:
        return Outcome(Result.ERROR, failure=_failure(error, with_traceback=False), permanent=True)
    token = _current_job.set(job)
    try:
        if task.is_async:
            async_to_sync(task.func)(**job.payload)
        else:
            task.func(**job.payload)
    except Retry as retry:
        return Outcome(Result.RETRY, delay=retry.delay)
    except BaseException as error:
        settings = get_settings()
        backoff = task.backoff or ExponentialBackoff(settings.BACKOFF_BASE, settings.BACKOFF_MAX)
        return Outcome(
            Result.ERROR,
            delay=backoff(job.attempts),
            failure=_failure(error),
            permanent=is_permanent(error, task.permanent_errors),
        )
    finally:
        _current_job.reset(token)
    return SUCCEEDED


def settle(job: Job, outcome: Outcome) -> bool:
    """Record one outcome through the manager; False when the job's lease was lost meanwhile."""
    from django_pgjobs.models import Job

    if outcome.result is Result.SUCCEEDED:
        return Job.objects.complete(job, outcome.result_json)
    if outcome.result is Result.RETRY:
        return Job.objects.retry_later(job, outcome.delay)
    assert outcome.failure is not None
    status = Job.objects.fail(
        job, outcome.failure, permanent=outcome.permanent, delay=outcome.delay
    )
    return status is not None


def _check_arguments(task: registry.Task, payload: object) -> None:
    if not isinstance(payload, dict):
        raise PayloadMismatch(
            f"payload must be a JSON object of keyword arguments, got {type(payload).__name__}"
        )
    try:
        _signature(task.func).bind(**payload)
    except TypeError as error:
        raise PayloadMismatch(f"payload does not fit {task.name}(): {error}") from None


@lru_cache(maxsize=1024)
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    # Computing a signature costs more than running a small handler; functions don't change.
    return inspect.signature(func)


def _failure(error: BaseException, *, with_traceback: bool = True) -> Failure:
    kind = type(error)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    tail = "".join(traceback.format_exception(error)) if with_traceback else ""
    return Failure(type=name, message=str(error), traceback=tail)
