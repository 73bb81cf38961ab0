"""Running an `async def` handler: its coroutine to its end, on an event loop of its own.

asgiref's async_to_sync runs the coroutine (asyncio.run, on a thread of its own) while the
thread that called it runs the coroutine's sync_to_async calls (Django's async ORM among them:
thread sensitive, on that thread's connections). When the coroutine returns, asyncio.run
cancels the tasks it left running and waits for every one of them to end, so a task that
ignores its cancellation (a library's loop that catches CancelledError and goes on) kept the
loop, and the handler thread waiting for it, for good: the worker recorded a job that had
succeeded as timed out, or kept it `running` for ever when its task had no time limit.

So a companion thread of each handler thread awaits its coroutines (kept from one job to the
next, with its connections, as the handler thread keeps its own), and the handler thread takes
the coroutine's own result or error as soon as the coroutine returns. The companion then has
LEFTOVERS_GRACE seconds to end what the coroutine left. One still busy after that is left to
linger (counted with the threads abandoned past their time limits, which recycle the worker
when they pile up: see Worker._turn), and the handler thread's next async job gets a new one.

An attempt past its time limit has its coroutine cancelled (cancel): unlike a thread, a
coroutine can be stopped, at its next await. One that catches its CancelledError and goes on
runs on, as a sync handler past its limit does.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django.db import close_old_connections, connections

from django_pgjobs.runtime.logs import quietly

if TYPE_CHECKING:
    from django_pgjobs.models import Job

logger = logging.getLogger("django_pgjobs.runtime.worker")

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
_running: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = {}  # id(job) → its
_running_lock = threading.Lock()  # coroutine's task, while it runs


def awaited(job: Job, func: AsyncFunction, /, *args: Any, **kwargs: Any) -> Any:
    """`await func(*args, **kwargs)`, `job`'s handler, from this (handler) thread to the
    coroutine's end: its value, or what it raised (see the module's text)."""
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
            quietly(
                logger.warning,
                "job %s (%s): " + what + "; their event loop is left running on a thread of "
                "its own",
                job.pk, job.task, LEFTOVERS_GRACE,
            )  # fmt: skip


def cancel(job: Job) -> None:
    """Cancel `job`'s coroutine, if its async handler is running: CancelledError is raised in
    it at its next await (an attempt past its time limit: HandlerPool.time_out)."""
    with _running_lock:
        running = _running.get(id(job))
    if running is not None:
        loop, task = running
        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: it has ended
            loop.call_soon_threadsafe(task.cancel)


def release() -> None:
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
    """One handler thread's companion, which awaits its async handlers one at a time."""

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
    (before asyncio ends the tasks it left), and which `cancel(job)` cancels while it runs. The
    error is not raised again here: the handler thread raises it, and its traceback gets only
    that thread's frames after the coroutine's, not this companion's too (one exception object
    raised in two threads collects both's frames)."""

    async def answering(*args: Any, **kwargs: Any) -> None:
        task = asyncio.current_task()
        if task is not None:  # always: async_to_sync runs it as a task
            with _running_lock:
                _running[id(job)] = (asyncio.get_running_loop(), task)
        try:
            value = await func(*args, **kwargs)
        except BaseException as error:
            answer.set_exception(error)
        else:
            answer.set_result(value)
        finally:
            with _running_lock:
                _running.pop(id(job), None)

    return answering
