"""Running one claimed job: find its task in the registry, call it, and classify the outcome."""

from __future__ import annotations

import inspect
import json
import time
import traceback
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync

from django_pgjobs import registry
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import PayloadMismatch, PermanentError, Retry, UnknownTask
from django_pgjobs.manager import Failure
from django_pgjobs.retry import ExponentialBackoff, is_permanent
from django_pgjobs.signals import OUTCOME_OF_STATUS

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


_current_job: ContextVar[Job | None] = ContextVar("pgjobs_current_job", default=None)


def current_job() -> Job | None:
    """The job whose handler is running in this thread (or task), else None.

    Its ``id``, ``attempts`` and ``worker`` identify this attempt, e.g. for idempotency keys.
    """
    return _current_job.get()


def run(job: Job) -> Outcome:
    """Call the job's registered handler with its payload as keyword arguments. Never raises:
    whatever the handler raises, SystemExit and KeyboardInterrupt included, becomes an Outcome.

    A job of Django's Tasks framework (see backend.py) is dispatched to its Task instead."""
    if registry.is_django_task(job.task):
        return _run_django_task(job)
    try:
        task = registry.get_task(job.task)
        _check_arguments(task.func, task.name, (), job.payload)
    except (UnknownTask, PayloadMismatch) as error:
        # Never import by name from table data: an unknown task is a dead letter.
        return Outcome(Result.ERROR, failure=_failure(error, with_traceback=False), permanent=True)
    token = _current_job.set(job)
    started = time.perf_counter()
    try:
        if task.is_async:
            async_to_sync(task.func)(**job.payload)
        else:
            task.func(**job.payload)
    except BaseException as error:
        return _error(job, error, task.backoff, task.permanent_errors, started)
    finally:
        _current_job.reset(token)
    return Outcome(Result.SUCCEEDED, duration=time.perf_counter() - started)


def _run_django_task(job: Job) -> Outcome:
    """Run a job of Django's Tasks framework: its Task with the payload's args and kwargs (and a
    TaskContext first when the Task takes one), sending the framework's task signals. The return
    value is kept as the job's result; one that does not survive JSON fails the job."""
    try:
        task = registry.get_django_task(job.task)  # UnknownTask if the framework is missing
        from django_pgjobs import backend

        result = backend.running(job, task)
        args = [backend.context(result), *result.args] if task.takes_context else result.args
        _check_arguments(task.func, task.module_path, args, result.kwargs)
    except (UnknownTask, PayloadMismatch) as error:
        return Outcome(Result.ERROR, failure=_failure(error, with_traceback=False), permanent=True)
    except Exception as error:  # e.g. a broken TASKS setting: retried, as it may be fixed
        return _error(job, error, None, (), time.perf_counter())
    backend.started(result)
    token = _current_job.set(job)
    started = time.perf_counter()
    try:
        value = task.call(*args, **result.kwargs)
        try:
            result_json = backend.result_json(value)
        except (TypeError, ValueError) as error:
            raise PermanentError(f"{task.module_path}: {error}") from error
    except BaseException as error:
        outcome = _error(job, error, None, (), started)
        if outcome.result is Result.ERROR and (
            outcome.permanent or job.attempts >= job.max_attempts
        ):
            backend.finished(result, error=error)
        return outcome
    finally:
        _current_job.reset(token)
    duration = time.perf_counter() - started
    backend.finished(result, json.loads(result_json))
    return Outcome(Result.SUCCEEDED, duration=duration, result_json=result_json)


def _error(
    job: Job,
    error: BaseException,
    backoff: registry.Backoff | None,
    permanent_errors: tuple[type[BaseException], ...],
    started: float,
) -> Outcome:
    """The outcome of a handler that raised: Retry asks to run again later; anything else is an
    error, permanent or retried after a backoff."""
    duration = time.perf_counter() - started
    if isinstance(error, Retry):
        return Outcome(Result.RETRY, delay=error.delay, duration=duration)
    settings = get_settings()
    backoff = backoff or ExponentialBackoff(settings.BACKOFF_BASE, settings.BACKOFF_MAX)
    return Outcome(
        Result.ERROR,
        delay=backoff(job.attempts),
        failure=_failure(error),
        permanent=is_permanent(error, permanent_errors),
        duration=duration,
    )


def settle(job: Job, outcome: Outcome) -> str:
    """Record one outcome through the manager. Returns what was recorded, as the worker counts
    it: succeeded, retried, failed, cancelled, or lost when the job's lease was lost meanwhile."""
    from django_pgjobs.models import Job

    if outcome.result is Result.SUCCEEDED:
        return "succeeded" if Job.objects.complete(job, outcome.result_json) else "lost"
    if outcome.result is Result.RETRY:
        return "retried" if Job.objects.retry_later(job, outcome.delay) else "lost"
    assert outcome.failure is not None
    status = Job.objects.fail(
        job, outcome.failure, permanent=outcome.permanent, delay=outcome.delay
    )
    return OUTCOME_OF_STATUS.get(status or "", "lost")


def _check_arguments(
    func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: object
) -> None:
    if not isinstance(kwargs, dict):
        raise PayloadMismatch(
            f"payload must be a JSON object of keyword arguments, got {type(kwargs).__name__}"
        )
    try:
        _signature(func).bind(*args, **kwargs)
    except TypeError as error:
        raise PayloadMismatch(f"payload does not fit {name}(): {error}") from None


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
