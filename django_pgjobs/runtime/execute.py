"""Running one claimed job, and what its handler runs in: an event loop for `async def` handlers,
current_job(), cancel_requested() and progress()."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from contextvars import ContextVar
from decimal import Decimal
from numbers import Integral, Real
from types import CodeType
from typing import Any
from weakref import WeakKeyDictionary

from asgiref.sync import async_to_sync
from django.db import close_old_connections, connections, router

from django_pgjobs import registry, signals
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data.records import Failure, clean_text
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.errors import JobTimeout, PayloadMismatch, Retry, UnknownTask, text_of
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.retry import BACKOFF_PATIENCE, ExponentialBackoff, backoff_seconds, is_permanent
from django_pgjobs.runtime.reporting import log_safely

# What goes wrong around a job's handler is said with the worker's lines about its jobs.
logger = logging.getLogger("django_pgjobs.runtime.worker")

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
                awaited(job, task.func, **job.payload)
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


def past_time_limit(job: Job, timeout: float, kept: Handled | None, log: logging.Logger) -> Handled:
    """How an attempt abandoned at its time limit (Handlers.time_out) is recorded, said on
    `log`: as timed out (JobTimeout), unless its handler had returned and its runner kept
    the outcome before (handlers.kept): then that outcome, which its runner may have told
    already (Django's task_finished; it was its receivers that passed the limit)."""
    if kept is None:  # said once, by the outcome's line (JobTimeout, its time limit)
        return timed_out(job, timeout)
    log_safely(
        log.warning,
        "job %s (%s) returned within its time limit of %gs, and what ran after it (its "
        "task_finished signal's receivers, say) passed it: recorded as it ended (%s), its "
        "thread left to finish",
        job.pk, job.task, timeout, kept.verdict.value,
    )  # fmt: skip
    return kept


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


# ---- async def handlers -------------------------------------------------------------------------

#: Seconds a handler thread waits, after an async handler's coroutine returned, for the tasks it
#: left running to end once cancelled.
LEFTOVERS_GRACE = 1.0

AsyncFunction = Callable[..., Coroutine[Any, Any, Any]]
_Work = tuple[
    "Job", AsyncFunction, tuple[Any, ...], dict[str, Any], contextvars.Context, "Future[Any]"
]

_local = threading.local()  # this handler thread's Awaiter
_lingering: list[threading.Thread] = []  # companions left with tasks that ignore cancellation
_lingering_lock = threading.Lock()
_coroutines: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = {}  # id(job) → its
_coroutines_lock = threading.Lock()  # coroutine's task, while it runs


def awaited(job: Job, func: AsyncFunction, /, *args: Any, **kwargs: Any) -> Any:
    """`await func(*args, **kwargs)`, `job`'s handler, from this (handler) thread to the
    coroutine's end: its value, or what it raised (see Awaiter)."""
    awaiter: Awaiter | None = getattr(_local, "awaiter", None)
    if awaiter is None:
        awaiter = _local.awaiter = Awaiter(f"{threading.current_thread().name}-async")
    try:
        return awaiter.call(job, func, args, kwargs)
    finally:
        if not awaiter.settled():
            _local.awaiter = None
            awaiter.stop()  # it ends, closing its connections, if its loop ever does
            with _lingering_lock:
                _lingering.append(awaiter.thread)
            if job.cancel_requested:  # cancelled at its time limit: the outcome is that
                what = (
                    "its async handler was cancelled at its time limit, but what it awaited (a "
                    "sync_to_async call, or a task that ignores its cancellation) did not end "
                    "within %gs"
                )
            else:
                what = (
                    "its async handler returned, leaving tasks that did not end within %gs of "
                    "their cancellation (the job's outcome is the handler's)"
                )
            log_safely(
                logger.warning,
                "job %s (%s): " + what + "; their event loop is left running on a thread of "
                "its own",
                job.pk, job.task, LEFTOVERS_GRACE,
            )  # fmt: skip


def cancel_coroutine(job: Job) -> None:
    """Cancel `job`'s coroutine, if its async handler is running: CancelledError is raised in
    it at its next await (an attempt past its time limit: HandlerPool.time_out)."""
    with _coroutines_lock:
        running = _coroutines.get(id(job))
    if running is not None:
        loop, task = running
        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: it has ended
            loop.call_soon_threadsafe(task.cancel)


def release_awaiter() -> None:
    """This handler thread ends: so does its companion."""
    awaiter: Awaiter | None = getattr(_local, "awaiter", None)
    if awaiter is not None:
        _local.awaiter = None
        awaiter.stop()


def lingering() -> int:
    """Companion threads left running their coroutines' leftovers, still alive."""
    with _lingering_lock:
        _lingering[:] = [thread for thread in _lingering if thread.is_alive()]
        return len(_lingering)


class Awaiter:
    """One handler thread's companion, which awaits its async handlers one at a time.

    asgiref's async_to_sync runs the coroutine (asyncio.run, on a thread of its own) while the
    thread that called it runs the coroutine's sync_to_async calls (Django's async ORM among
    them: thread sensitive, on that thread's connections). When the coroutine returns,
    asyncio.run cancels the tasks it left running and waits for every one of them to end, so a
    task that ignores its cancellation (a library's loop that catches CancelledError and goes
    on) kept the loop, and the handler thread waiting for it, for good: the worker recorded a
    job that had succeeded as timed out, or kept it `running` for ever when its task had no
    time limit.

    So a companion thread of each handler thread awaits its coroutines (kept from one job to
    the next, with its connections, as the handler thread keeps its own), and the handler
    thread takes the coroutine's own result or error as soon as the coroutine returns. The
    companion then has LEFTOVERS_GRACE seconds to end what the coroutine left. One still busy
    after that is left to linger (counted with the threads abandoned past their time limits,
    which recycle the worker when they pile up: see Worker._turn), and the handler thread's
    next async job gets a new one.

    An attempt past its time limit has its coroutine cancelled (cancel_coroutine): unlike a
    thread, a coroutine can be stopped, at its next await. One that catches its CancelledError
    and goes on runs on, as a sync handler past its limit does.
    """

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def call(
        self, job: Job, func: AsyncFunction, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Await `func(*args, **kwargs)`, `job`'s handler, on this companion, in the caller's
        context (its current_job, its tracing span); the coroutine's value, or what it raised."""
        answer: Future[Any] = Future()
        self._idle.clear()
        self._work.put((job, func, args, kwargs, contextvars.copy_context(), answer))
        return answer.result()

    def settled(self) -> bool:
        """Whether the last coroutine's event loop ended within LEFTOVERS_GRACE."""
        return self._idle.wait(LEFTOVERS_GRACE)

    def stop(self) -> None:
        self._work.put(None)

    def _serve(self) -> None:
        try:
            while (work := self._work.get()) is not None:
                job, func, args, kwargs, context, answer = work
                try:
                    close_old_connections()  # as the handler thread does around each job
                    context.run(async_to_sync(_answering(job, func, answer)), *args, **kwargs)
                    close_old_connections()
                except BaseException as error:  # raised before the coroutine ran, or after:
                    if not answer.done():  # the handler thread's to classify, never to wait on
                        answer.set_exception(error)
                finally:
                    self._idle.set()
        finally:
            connections.close_all()


def _answering(job: Job, func: AsyncFunction, answer: Future[Any]) -> AsyncFunction:
    """`func`, `job`'s handler, which puts its value or error in `answer` as soon as it has one
    (before asyncio ends the tasks it left), and which `cancel_coroutine(job)` cancels while it
    runs. The error is not raised again here: the handler thread raises it, and its traceback
    gets only that thread's frames after the coroutine's, not this companion's too (one
    exception object raised in two threads collects both's frames)."""

    async def answering(*args: Any, **kwargs: Any) -> None:
        task = asyncio.current_task()
        if task is not None:  # always: async_to_sync runs it as a task
            with _coroutines_lock:
                _coroutines[id(job)] = (asyncio.get_running_loop(), task)
        try:
            value = await func(*args, **kwargs)
        except BaseException as error:
            answer.set_exception(error)
        else:
            answer.set_result(value)
        finally:
            with _coroutines_lock:
                _coroutines.pop(id(job), None)

    return answering


# ---- cancel_requested() -------------------------------------------------------------------------

#: How often cancel_requested() asks the database; between asks, the worker's heartbeats
#: also bring the news.
CHECK_INTERVAL = 1.0

_checked_at: WeakKeyDictionary[Job, float] = WeakKeyDictionary()


def cancel_requested() -> bool:
    """True when a cancellation of the running job was requested (admin action "Cancel", or
    ``Job.objects.filter(...).cancel()``). Call it between steps of long work, in a plain or an
    ``async def`` handler; then stop, e.g. by raising ``JobCancelled``. Outside a job it is
    False.

    The answer is at most CHECK_INTERVAL seconds old: it asks the database (a primary-key
    lookup) at most that often per job.
    """
    job = current_job()
    if job is None:
        return False
    if not job.cancel_requested:
        now = time.monotonic()
        if now - _checked_at.get(job, 0.0) >= CHECK_INTERVAL:
            _checked_at[job] = now
            if _asked_now(job):
                job.cancel_requested = True
    return job.cancel_requested


def _asked_now(job: Job) -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a plain handler: ask on this thread's connection
        return cancel_asked(job)
    # An async handler's event loop may not run queries (SynchronousOnlyOperation): ask from a
    # short-lived thread with its own connection. A primary-key lookup, once a second at most.
    answer: list[bool] = []

    def ask() -> None:
        try:
            answer.append(cancel_asked(job))
        finally:
            connections.close_all()  # this thread's own connection

    thread = threading.Thread(target=ask, name="pgjobs-cancel-check", daemon=True)
    thread.start()
    thread.join()
    return bool(answer and answer[0])


def cancel_asked(job: Job) -> bool:
    """Whether a cancellation of `job` was requested, asked of the database on this thread."""
    # The write database, where the request was written: a replica behind a router may lag.
    jobs = Job.objects.db_manager(router.db_for_write(Job))
    asked: bool = jobs.filter(pk=job.pk, cancel_requested=True).exists()
    return asked


# ---- progress() ---------------------------------------------------------------------------------

#: How many characters of a note are kept; a longer one is cut, ending in "…".
NOTE_LENGTH = 200

#: How many characters of a bad value's repr an error message shows.
SHOWN_LENGTH = 40


def progress(done: float, total: float | None = None, note: str = "") -> None:
    """Report the running job's progress: `done` of `total` (None: a total not known), with a
    short `note` ("invoice 1,204", "uploading").

    Cheap enough to call for every item: it only keeps the latest report on the job in memory
    (``current_job().progress``); the worker writes it with its next round, about once a second,
    and with the job's outcome. Outside a job (a test calling the function directly) it checks
    its arguments and does nothing else. TypeError or ValueError for a report that cannot be
    shown: `done` and `total` must be finite numbers of 0 or more, `done` at most `total`, and
    `note` a str (cut to NOTE_LENGTH characters).
    """
    report = checked_progress(done, total, note)
    job = current_job()
    if job is None:
        return
    job.progress = report
    signals.send(signals.job_progress, Job, job=job, **report)


def checked_progress(done: Any, total: Any, note: Any) -> dict[str, Any]:
    """The report as it is stored (before the worker adds "at"); raises saying what is wrong."""
    done = _number("done", done)
    if total is not None:
        total = _number("total", total)
        if done > total:
            raise ValueError(
                f"progress(done={_shown(done)}, total={_shown(total)}): done is more than total; "
                "pass total=None while the total is not known."
            )
    if not isinstance(note, str):
        raise TypeError(f"progress(note=...) must be a str, got {type(note).__name__}.")
    # Cut before cleaning, which only ever lengthens: the same note without copying a huge one.
    note = clean_text(note[: NOTE_LENGTH + 1], NOTE_LENGTH)
    return {"done": done, "total": total, "note": note}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, Decimal)):
        raise TypeError(f"progress({name}=...) must be a number, got {type(value).__name__}.")
    number = _finite(value)
    if number is None:
        raise ValueError(f"progress({name}={_shown(value)}) must be a finite number.")
    if number < 0:
        raise ValueError(f"progress({name}={_shown(value)}) must be 0 or more.")
    return number


def _finite(value: Real | Decimal) -> float | None:
    """`value` as an int or a float; None when it is not finite, or too large for a float (no
    bar can show it)."""
    if isinstance(value, Decimal) and not value.is_finite():
        return None  # NaN, Infinity, and a signalling NaN, which float() refuses
    try:
        number = int(value) if isinstance(value, Integral) else float(value)
        return number if math.isfinite(number) else None
    except OverflowError:  # beyond a float's range
        return None


def _shown(value: Any) -> str:
    """`value` in an error message: its repr, cut to SHOWN_LENGTH characters; never an error of
    its own (an int of more digits than Python converts to text, a repr that raises)."""
    try:
        return clean_text(repr(value), SHOWN_LENGTH)
    except Exception:
        return f"<{type(value).__qualname__}>"
