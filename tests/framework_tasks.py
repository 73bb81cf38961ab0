"""Tasks of Django's Tasks framework (django.tasks, or the django-tasks backport on Django 5.2),
run through django_pgjobs.backend.PgJobsBackend."""

from __future__ import annotations

import asyncio
from typing import Any

from django.utils import timezone

try:
    from django.tasks import TaskContext, task
    from django.tasks.signals import task_finished, task_started
except ImportError:
    from django_tasks import TaskContext, task  # type: ignore[no-redef]
    from django_tasks.signals import task_finished, task_started  # type: ignore[no-redef]


@task
def noop(*args: Any, **kwargs: Any) -> None:
    pass


@task
async def noop_async(*args: Any, **kwargs: Any) -> None:
    await asyncio.sleep(0)


@task
def calculate_meaning_of_life() -> int:
    return 42


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": args, "kwargs": kwargs}


@task
async def add_async(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task
def returns_late(seconds: float) -> str:
    """Takes `seconds`, then returns (past a short PGJOBS["TIMEOUT"])."""
    import time

    time.sleep(seconds)
    return "late"


@task
async def ignores_its_cancellation() -> None:
    """Swallows its cancellation and awaits on, until tests.hostile.stubborn_tasks_end is set."""
    from tests.hostile import _ignores_cancellation

    await _ignores_cancellation()


@task
async def add_async_leaving_a_stubborn_task(a: int, b: int) -> int:
    """add_async, leaving a task that ignores its cancellation (tests/hostile.py)."""
    from tests.hostile import _ignores_cancellation

    asyncio.get_running_loop().create_task(_ignores_cancellation())
    await asyncio.sleep(0)
    return a + b


@task(priority=10, queue_name="queue-1")
def important(n: int = 0) -> int:
    return n


@task
def failing_value_error() -> None:
    raise ValueError("This task failed due to ValueError")


@task
def exit_task() -> None:
    raise SystemExit(1)


@task
def returns_a_datetime() -> object:
    return timezone.now()


@task(backend="retrying")
def returns_a_set() -> object:
    return {1, 2}


@task(backend="retrying")
def returns_nan() -> float:
    return float("nan")


@task(takes_context=True)
def sees_its_context(context: TaskContext[Any, Any], value: str) -> dict[str, Any]:
    return {
        "attempt": context.attempt,
        "id": context.task_result.id,
        "status": str(context.task_result.status),
        "value": value,
        "worker_ids": context.task_result.worker_ids,
    }


@task(takes_context=True, backend="retrying")
def succeeds_on_the_third_attempt(context: TaskContext[Any, Any]) -> int:
    if context.attempt < 3:
        raise ConnectionError(f"attempt {context.attempt} failed")
    return context.attempt


@task(backend="immediate")
def of_another_backend() -> None:
    pass


def not_a_task() -> None:
    """A plain function: a job naming it must never run."""


@task(backend="retrying")
def record(n: int, seconds: float = 0.0) -> int:
    """Write a ledger row, then take `seconds`; returns the worker's pid."""
    import os
    import time

    from tests.models import Execution

    Execution.objects.create(n=n, pid=os.getpid())
    time.sleep(seconds)
    return os.getpid()


@task
async def reports_progress_async(steps: int) -> None:
    from django_pgjobs import progress

    for step in range(1, steps + 1):
        await asyncio.sleep(0)
        progress(step, steps, note=f"async step {step}")


@task
def its_receiver_takes_a_moment(seconds: float, receiver_seconds: float) -> None:
    """Takes `seconds`; its task_finished receiver (below) takes `receiver_seconds`, then
    writes an Execution row whose n is -1 (FAILED) or 1 (any other status)."""
    import time

    time.sleep(seconds)


def _takes_a_moment(sender: Any, task_result: Any, **kwargs: Any) -> None:
    if task_result.task.func is not its_receiver_takes_a_moment.func:
        return
    import os
    import time

    from tests.models import Execution

    time.sleep(task_result.kwargs["receiver_seconds"])
    failed = str(task_result.status) == "FAILED"
    Execution.objects.create(n=-1 if failed else 1, pid=os.getpid())


task_finished.connect(_takes_a_moment)


@task
def its_start_takes_a_moment(start_seconds: float) -> None:
    """Writes an Execution row (n=2) once its task_started receiver (below) has taken
    `start_seconds`."""
    import os

    from tests.models import Execution

    Execution.objects.create(n=2, pid=os.getpid())


def _starts_slowly(sender: Any, task_result: Any, **kwargs: Any) -> None:
    if task_result.task.func is its_start_takes_a_moment.func:
        import time

        [seconds] = [*task_result.args, *task_result.kwargs.values()]
        time.sleep(seconds)


task_started.connect(_starts_slowly)
