"""Hostile handlers: tasks that do what a handler should never do, for the crash tests.

Each one breaks a rule of the handler contract (errors that cannot be printed, delays that do
not fit a timestamp, a process that exits, a broken or closed connection, a lock wait, floods of
text). Whatever they do, a worker must record an outcome for them and keep serving other jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from datetime import timedelta

from django.db import DatabaseError, connection, transaction

from django_pgjobs import Retry, current_job, signals, task

logger = logging.getLogger(__name__)

MEGABYTE = 1024 * 1024


class Unprintable(Exception):
    """An error whose text cannot be computed: str() and repr() both raise."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of Unprintable raised")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ of Unprintable raised")


class NotAnException(BaseException):
    """A BaseException that is not an Exception (as asyncio.CancelledError and GeneratorExit)."""


@task(max_attempts=1)
def raises_unprintable() -> None:
    raise Unprintable("never shown")


@task(max_attempts=1)
def retries_never() -> None:
    raise Retry(delay=float("inf"))


@task(max_attempts=1)
def retries_in_1e17_seconds() -> None:
    raise Retry(delay=1e17)


@task(max_attempts=2, backoff=lambda attempts: timedelta(seconds=1))
def fails_with_timedelta_backoff() -> None:
    raise RuntimeError("failed; its backoff is a timedelta")


@task(max_attempts=3, backoff=lambda attempts: 1e17)
def fails_with_1e17_backoff() -> None:
    raise RuntimeError("failed; its backoff is 1e17 seconds")


@task(max_attempts=3, backoff=lambda attempts: float("inf"))
def fails_with_infinite_backoff() -> None:
    raise RuntimeError("failed; its backoff is infinite")


#: Set to let every call of hanging_backoff return (tests in one process release theirs).
BACKOFF_RELEASED = threading.Event()


def hanging_backoff(attempts: int) -> float:
    """A backoff that does not return (until BACKOFF_RELEASED is set, or ten minutes pass)."""
    BACKOFF_RELEASED.wait(600)
    return 1.0


@task(max_attempts=3, timeout=1, backoff=hanging_backoff)
def times_out_and_its_backoff_hangs() -> None:
    """Runs past its one-second time limit: the worker's main thread then asks its backoff."""
    time.sleep(60)


def slow_backoff(attempts: int) -> float:
    """A backoff that answers, slowly (a lookup elsewhere): 600 s after 0.3 s."""
    time.sleep(0.3)
    return 600.0


@task(max_attempts=3, backoff=slow_backoff)
def has_a_slow_backoff() -> None:
    raise RuntimeError("failed; its backoff takes 0.3 s to answer")


def exiting_backoff(attempts: int) -> float:
    raise SystemExit(4)


@task(max_attempts=3, timeout=1, backoff=exiting_backoff)
def times_out_and_its_backoff_exits() -> None:
    """Runs past its time limit; its backoff, asked on the worker's main thread, exits."""
    time.sleep(60)


@task(max_attempts=1)
def exits_the_process() -> None:
    os._exit(1)


@task(max_attempts=1)
def returns_an_object() -> object:
    return object()


@task(max_attempts=1)
def forks_and_returns(path: str) -> None:
    """Forks, and both processes return (as a library that forks without os._exit in the child
    does); the child says its pid first."""
    if os.fork() == 0:
        with open(path, "w") as out:
            out.write(str(os.getpid()))


@task(max_attempts=1)
def leaves_a_thread_behind() -> None:
    """Starts a thread that outlives its job and is no daemon: Python's exit waits for those."""
    threading.Thread(target=time.sleep, args=(3600,), name="left behind", daemon=False).start()


@task(max_attempts=1)
def leaves_a_pool_behind() -> None:
    """Leaves a thread pool running a long task: Python's exit waits for its threads, daemon or
    not (concurrent.futures joins them at exit)."""
    from concurrent.futures import ThreadPoolExecutor

    ThreadPoolExecutor(1, thread_name_prefix="pool left behind").submit(time.sleep, 3600)


@task(max_attempts=1)
def swallows_a_database_error(n: int) -> None:
    """Writes ledger row n, then catches PostgreSQL's error inside atomic() and carries on."""
    from tests.models import Execution

    Execution.objects.create(n=n, pid=os.getpid())
    with transaction.atomic():
        Execution.objects.create(n=-n, pid=os.getpid())
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
        except DatabaseError:
            pass


@task(max_attempts=1)
def leaves_a_transaction_open(n: int) -> None:
    """Opens a transaction behind Django's back, writes ledger row n in it and returns."""
    from tests.models import Execution

    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
    Execution.objects.create(n=n, pid=os.getpid())


@task(max_attempts=1)
def closes_its_connection() -> None:
    connection.ensure_connection()
    connection.close()


@task(max_attempts=1)
def closes_the_raw_connection() -> None:
    """Closes the psycopg connection under Django's wrapper, which still thinks it is open."""
    connection.ensure_connection()
    connection.connection.close()


@task(max_attempts=1)
def raises_base_exception() -> None:
    raise NotAnException("not an Exception")


@task(max_attempts=1)
def raises_system_exit() -> None:
    raise SystemExit(3)


@task(max_attempts=1)
def raises_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@task(max_attempts=1)
def floods(megabytes: int = 5) -> None:
    """Logs `megabytes` of text, then raises an error whose message is as long."""
    logger.error("flood %s", "x" * megabytes * MEGABYTE)
    raise RuntimeError("y" * megabytes * MEGABYTE)


@task(max_attempts=1)
def waits_for_a_row_lock(n: int) -> None:
    """Locks ledger row n (waiting for whoever holds it), then writes ledger row n + 1."""
    from tests.models import Execution

    with transaction.atomic():
        Execution.objects.select_for_update().get(n=n)
    Execution.objects.create(n=n + 1, pid=os.getpid())


@task(max_attempts=1)
def locks_its_own_job_row(seconds: float) -> None:
    """Holds a lock on its own job's row for `seconds` (as a handler that re-reads its job with
    select_for_update inside a long transaction)."""
    job = current_job()
    assert job is not None
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [job.pk])
        time.sleep(seconds)


@task(max_attempts=1)
async def checks_for_cancellation_asynchronously() -> None:
    """An async handler asking cancel_requested() (a query, from inside an event loop)."""
    from django_pgjobs import JobCancelled, cancel_requested

    if cancel_requested():
        raise JobCancelled("asked to stop")


#: Ends the tasks `leaves_a_task_that_ignores_cancellation` leaves (a test's teardown sets it).
stubborn_tasks_end = threading.Event()


async def _ignores_cancellation() -> None:
    while not stubborn_tasks_end.is_set():
        # A library's loop that swallows its cancellation and goes on.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)


@task(max_attempts=1)
async def leaves_a_task_that_ignores_cancellation() -> None:
    """Succeeds, leaving a task running that catches its cancellation and goes on (asyncio.run
    cancels it, then waits for it to end)."""
    asyncio.get_running_loop().create_task(_ignores_cancellation())
    await asyncio.sleep(0)


@task(max_attempts=1)
def announced_to_a_hanging_receiver() -> None:
    """Succeeds; a job_succeeded receiver (below) then never returns."""


@task(max_attempts=1)
def announced_to_an_exiting_receiver() -> None:
    """Succeeds; a job_succeeded receiver (below) then raises SystemExit."""


def hostile_receiver(sender: object, job: object, **kwargs: object) -> None:
    """What an application's receiver may do: wait on something that never answers, exit."""
    task_name = getattr(job, "task", "")
    if task_name == "tests.hostile.announced_to_a_hanging_receiver":
        threading.Event().wait(600)
    elif task_name == "tests.hostile.announced_to_an_exiting_receiver":
        raise SystemExit(5)


signals.job_succeeded.connect(hostile_receiver, weak=False)


@task(max_attempts=1)
def ticks_to_a_hanging_receiver() -> None:
    """A periodic task; a job_enqueued receiver (below) never returns for its jobs."""


@task(max_attempts=1)
def ticks_to_an_exiting_receiver() -> None:
    """A periodic task; a job_enqueued receiver (below) raises SystemExit for its jobs."""


def hostile_enqueued_receiver(sender: object, jobs: list[object], **kwargs: object) -> None:
    tasks = {getattr(job, "task", "") for job in jobs}
    if "tests.hostile.ticks_to_a_hanging_receiver" in tasks:
        threading.Event().wait(600)
    elif "tests.hostile.ticks_to_an_exiting_receiver" in tasks:
        raise SystemExit(6)


signals.job_enqueued.connect(hostile_enqueued_receiver, weak=False)


@task(lease=120)
def has_a_long_lease() -> None:
    """A task with a lease of its own, longer than a worker's."""


@task(max_attempts=1)
async def raises_in_its_coroutine() -> None:
    await asyncio.sleep(0)
    raise ValueError("raised in the coroutine")


#: What `awaits_past_its_time_limit` saw: "cancelled" when its coroutine was cancelled.
async_time_limit_seen: list[str] = []


@task(max_attempts=1, timeout=0.5)
async def awaits_past_its_time_limit() -> None:
    """An async handler that awaits for much longer than its time limit."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        async_time_limit_seen.append("cancelled")
        raise


@task(max_attempts=1, timeout=0.5)
async def awaits_a_slow_sync_call_past_its_time_limit() -> None:
    """An async handler whose sync_to_async call outlasts its time limit (and its cancellation,
    which reaches the coroutine, not the call)."""
    from asgiref.sync import sync_to_async

    await sync_to_async(time.sleep)(3)
