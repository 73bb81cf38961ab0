"""Running one claimed job: find its task in the registry, call it, and classify how it ended."""

from __future__ import annotations

import logging
import time
import traceback
from contextvars import ContextVar
from types import CodeType
from typing import TYPE_CHECKING

from django_pgjobs import registry
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data.records import Failure
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.errors import JobTimeout, PayloadMismatch, Retry, UnknownTask, text_of
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.retry import BACKOFF_PATIENCE, ExponentialBackoff, backoff_seconds, is_permanent
from django_pgjobs.runtime import awaiting
from django_pgjobs.runtime.logs import quietly

if TYPE_CHECKING:
    from django_pgjobs.models import Job

_current_job: ContextVar[Job | None] = ContextVar("pgjobs_current_job", default=None)


def current_job() -> Job | None:
    """The job whose handler is running in this thread (or task), else None.

    Its ``id``, ``attempts`` and ``worker`` identify this attempt, e.g. for idempotency keys.
    """
    return _current_job.get()


def run(job: Job) -> Handled:
    """Call the job's registered handler with its payload as keyword arguments. Never raises:
    whatever the handler raises, SystemExit and KeyboardInterrupt included, becomes a Handled.

    A job of an integration (e.g. Django's Tasks framework, see backend.py) goes to its runner.
    With PGJOBS["TRACING"] on, it runs in its process span (tracing.py, imported only then).
    """
    if get_settings().TRACING:
        from django_pgjobs import tracing

        return tracing.processed(job, _run)
    return _run(job)


def _run(job: Job) -> Handled:
    if isinstance(job.payload, Unreadable):  # written by other means than enqueue
        return refused(
            PayloadMismatch(f"its payload cannot be read in Python ({job.payload.error})")
        )
    runner = registry.runner_for(job.task)
    if runner is not None:
        return runner(job)
    try:
        task = registry.get_task(job.task)
        check_arguments(task.func, task.name, (), job.payload)
    except UnknownTask as error:
        # Never import by name from table data: an unknown task is a dead letter, saying what
        # to do in place of a traceback (the lookup's own stack would say nothing).
        return refused(error, explained=registry.unknown_task_help(job.task))
    except PayloadMismatch as error:
        return refused(error)
    with running(job):
        started = time.perf_counter()
        try:
            if task.is_async:
                awaiting.awaited(job, task.func, **job.payload)
            else:
                task.func(**job.payload)
        except BaseException as error:
            return raised(job, error, task.backoff, task.permanent_errors, started)
    return Handled(Verdict.SUCCEEDED, duration=time.perf_counter() - started)


class running:
    """Makes `job` the current_job() while its handler runs."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __enter__(self) -> None:
        self.token = _current_job.set(self.job)

    def __exit__(self, *exc: object) -> None:
        _current_job.reset(self.token)


def refused(error: BaseException, *, explained: str = "") -> Handled:
    """A job that cannot run at all (unknown task, payload that does not fit): a permanent
    error, without a traceback (`explained` in its place, when given)."""
    failure = failure_of(error, with_traceback=False)
    failure = Failure(failure.type, failure.message, explained)
    return Handled(Verdict.ERROR, failure=failure, permanent=True)


def raised(
    job: Job,
    error: BaseException,
    backoff: registry.Backoff | None,
    permanent_errors: tuple[type[BaseException], ...],
    started: float,
    *,
    within: float | None = None,
) -> Handled:
    """How a handler that raised ended: Retry asks to run again later; anything else is an
    error, permanent or retried after a backoff. `within`: how long to wait for the task's own
    backoff (retry.backoff_seconds), when not on the handler's thread."""
    duration = time.perf_counter() - started
    if isinstance(error, Retry):
        return Handled(Verdict.RETRY, delay=error.delay, duration=duration)
    settings = get_settings()
    default = ExponentialBackoff(settings.BACKOFF_BASE, settings.BACKOFF_MAX)
    failure, note, permanent = failure_of(error), "", is_permanent(error, permanent_errors)
    try:
        if backoff is None:
            delay = default(job.attempts)
        else:
            delay = backoff_seconds(backoff, job.attempts, job.task, within=within)
    except TimeoutError as slow:
        # Slow, perhaps only this once: the default backoff, as the reaper does.
        delay, note = default(job.attempts), f"; {text_of(slow)}: the default backoff applies"
    except Exception as broken:
        # Another attempt would meet the same backoff: the job is dead-lettered, saying why.
        delay, note, permanent = 0.0, f"; and {text_of(broken)}", True
    if note:
        failure = Failure(failure.type, failure.message + note, failure.traceback)
    return Handled(
        Verdict.ERROR, delay=delay, failure=failure, permanent=permanent, duration=duration
    )


def timed_out(job: Job, timeout: float) -> Handled:
    """How an attempt that ran past its time limit ends: a failed attempt (JobTimeout), retried
    after the task's backoff or dead-lettered, like any error. Called on the worker's main
    thread: a backoff that does not return within BACKOFF_PATIENCE gives way to the default.
    An integration's job is told to its time-out hook (registry.add_runner)."""
    try:
        task = registry.get_task(job.task)
        backoff, permanent_errors = task.backoff, task.permanent_errors
    except UnknownTask:
        backoff, permanent_errors = None, ()
    error = JobTimeout(f"the attempt ran longer than its time limit of {timeout:g}s")
    started = time.perf_counter() - timeout
    handled = raised(job, error, backoff, permanent_errors, started, within=BACKOFF_PATIENCE)
    hook = registry.timed_out_hook(job.task)  # an integration's (Django's task_finished)
    if hook is not None:
        hook(job, error, handled)
    return handled


def past_time_limit(
    job: Job, timeout: float, decided: Handled | None, log: logging.Logger
) -> Handled:
    """How an attempt abandoned at its time limit (Handlers.time_out) is recorded, said on
    `log`: as timed out (JobTimeout), unless its handler had returned and its runner decided
    the outcome before (timeouts.decided): then that outcome, which its runner may have told
    already (Django's task_finished; it was its receivers that passed the limit)."""
    if decided is None:
        quietly(log.error, "job %s (%s) passed its time limit of %gs", job.pk, job.task, timeout)
        return timed_out(job, timeout)
    quietly(
        log.warning,
        "job %s (%s) returned within its time limit of %gs, and what ran after it (its "
        "task_finished signal's receivers, say) passed it: recorded as it ended (%s), its "
        "thread left to finish",
        job.pk, job.task, timeout, decided.verdict.value,
    )  # fmt: skip
    return decided


def settle(job: Job, handled: Handled) -> Outcome:
    """Record how one attempt ended, on its own (the worker batches instead). Returns the
    outcome recorded, LOST when the job's lease was lost meanwhile."""
    jobs = type(job).objects
    if handled.verdict is Verdict.SUCCEEDED:
        owned = jobs.complete(job, handled.result_json)
        return Outcome.SUCCEEDED if owned else Outcome.LOST
    if handled.verdict is Verdict.RETRY:
        owned = jobs.retry_later(job, handled.delay)
        return Outcome.RETRIED if owned else Outcome.LOST
    assert handled.failure is not None
    status = jobs.fail(job, handled.failure, permanent=handled.permanent, delay=handled.delay)
    return Outcome.of_status(status)


def limits_of(job: Job, default_lease: float) -> tuple[float, float | None]:
    """The lease (seconds) and time limit (seconds, or None) of `job`'s attempts: its task's,
    else the worker's lease and PGJOBS["TIMEOUT"]."""
    try:
        task = registry.get_task(job.task)
        lease, timeout = task.lease, task.timeout
    except UnknownTask:
        lease, timeout = None, None
    return lease or default_lease, timeout or get_settings().TIMEOUT


def failure_of(error: BaseException, *, with_traceback: bool = True) -> Failure:
    """The error history's entry for `error`, however broken the exception is: one whose
    __str__ or __repr__ raises still gives a record (the handler's bug must not become ours)."""
    tail = _traceback(error) if with_traceback else ""
    return Failure(type=exception_path(type(error)), message=text_of(error), traceback=tail)


def exception_path(kind: type[BaseException]) -> str:
    """How an exception class is named in the error history: builtins by their bare name."""
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


#: Formatted stacks by the code positions they pass through, so that a handler failing the same
#: way again (a retry storm, the hot error path) costs a lookup instead of formatting its stack
#: anew: formatting one costs about 100 µs, several times a no-op job's whole run. Bounded.
_STACKS: dict[tuple[tuple[CodeType, int], ...], str] = {}
STACKS_KEPT = 256


def _traceback(error: BaseException) -> str:
    try:
        if error.__cause__ is not None or (
            error.__context__ is not None and not error.__suppress_context__
        ):
            return "".join(traceback.format_exception(error))  # chained: formatted in full
        tb, key = error.__traceback__, []
        while tb is not None:
            key.append((tb.tb_frame.f_code, tb.tb_lasti))
            tb = tb.tb_next
        stack = _STACKS.get(tuple(key))
        if stack is None:
            stack = "".join(traceback.format_tb(error.__traceback__))
            if len(_STACKS) < STACKS_KEPT:
                _STACKS[tuple(key)] = stack
        header = "Traceback (most recent call last):\n" if key else ""
        return header + stack + "".join(traceback.format_exception_only(error))
    except BaseException:
        frames = "".join(traceback.format_tb(error.__traceback__))
        return f"{frames}{exception_path(type(error))}: {text_of(error)}"
