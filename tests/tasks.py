"""Every task the tests use, registered the way a user's app registers them."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ObjectDoesNotExist

from django_pgjobs import PermanentError, Retry, task

calls: Counter[str] = Counter()
_lock = threading.Lock()


def _count(name: str) -> None:
    with _lock:
        calls[name] += 1


@task
def noop() -> None:
    _count("noop")


@task(queue="emails", priority=10, max_attempts=7)
def send_email(to: str, subject: str = "") -> None:
    _count("send_email")


@task(max_attempts=3)
def always_fails() -> None:
    raise RuntimeError("boom")


@task
def fails_permanently() -> None:
    raise PermanentError("bad data")


@task
def missing_object() -> None:
    raise ObjectDoesNotExist("Order matching query does not exist.")


class BadInput(Exception):
    pass


@task(permanent_errors=[BadInput])
def raises_task_permanent() -> None:
    raise BadInput("no retry for this")


@task
def asks_to_retry(seconds: float = 30) -> None:
    raise Retry(delay=seconds)


@task
def exits() -> None:
    raise SystemExit(3)


@task
def interrupts() -> None:
    raise KeyboardInterrupt


@task
async def async_noop(value: int) -> None:
    await asyncio.sleep(0)
    _count(f"async_noop:{value}")


@task(name="custom.name", redact=["password"])
def named(password: str = "") -> None:
    _count("named")


@task(max_attempts=5)
def record(n: int, seconds: float = 0.0) -> None:
    """Write a ledger row, then take `seconds`: the crash tests' handler."""
    import os
    import time

    from tests.models import Execution

    Execution.objects.create(n=n, pid=os.getpid())
    time.sleep(seconds)


def _limited_run(key: str, n: int, seconds: float) -> None:
    """Write a LimitedRun row, take `seconds`, then write when it ended."""
    import os
    import time

    from django.db.models.functions import Now

    from tests.models import LimitedRun

    run = LimitedRun.objects.create(key=key, n=n, pid=os.getpid())
    time.sleep(seconds)
    LimitedRun.objects.filter(pk=run.pk).update(ended=Now())


@task(queue="limited", rate_limit="20/s", max_attempts=5)
def rated(n: int, seconds: float = 0.0) -> None:
    _limited_run("", n, seconds)


@task(queue="limited", concurrency_limit=2, limit_by="customer_id", max_attempts=5)
def export(customer_id: str, n: int, seconds: float = 0.0) -> None:
    _limited_run(customer_id, n, seconds)


@task(queue="limited", limit_by="customer_id", max_attempts=5)
def per_customer(customer_id: str, n: int, seconds: float = 0.0) -> None:
    _limited_run(customer_id, n, seconds)


@task(max_attempts=5)
def until_cancelled(n: int, timeout: float = 30.0) -> None:
    """Write ledger row n, then wait for a cancellation request; when it comes, write row -n
    (it was observed) and stop the way handlers are told to."""
    import os
    import time

    from django_pgjobs import JobCancelled, cancel_requested
    from tests.models import Execution

    Execution.objects.create(n=n, pid=os.getpid())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cancel_requested():
            Execution.objects.create(n=-n, pid=os.getpid())
            raise JobCancelled("stopped on request")
        time.sleep(0.02)


@task
def periodic_tick(tick: str) -> None:
    """The periodic tests' handler: scheduled with pass_tick=True, it receives its tick."""
    _count("periodic_tick")


seen_jobs: list[tuple[object, int, str | None]] = []


@task
def reports_its_job() -> None:
    from django_pgjobs import current_job

    job = current_job()
    assert job is not None
    seen_jobs.append((job.pk, job.attempts, job.worker))


@task(max_attempts=3, backoff=lambda attempts: 600.0)
def fails_and_waits() -> None:
    """Fails; each retry is due ten minutes later."""
    raise RuntimeError("try again later")


@task
def countdown(n: int) -> None:
    """Enqueues countdown(n - 1) until 0: jobs that enqueue jobs."""
    _count("countdown")
    if n > 0:
        countdown.enqueue(n=n - 1)


@task
def enqueues_itself() -> None:
    enqueues_itself.enqueue()


@task
def writes_then_breaks_the_transaction(n: int) -> None:
    """Writes a row, then makes PostgreSQL abort the transaction (division by zero)."""
    from django.db import connection

    from tests.models import Execution

    Execution.objects.create(n=n, pid=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 / 0")


@task
def opens_a_span() -> None:
    """Opens a span of its own: the tracing tests' handler. OpenTelemetry is imported here, not
    at the top: this module loads in every test, and untraced ones must never import it."""
    from opentelemetry import trace

    with trace.get_tracer("tests").start_as_current_span("inside the handler"):
        _count("opens_a_span")


# Handlers of every shape a payload is checked against, at enqueue and when the job runs.


@task
def positional_only(order_id: int, /, note: str = "") -> None:
    _count("positional_only")


@task
def keyword_only(*, order_id: int, note: str = "") -> None:
    _count("keyword_only")


@task
def takes_varargs(*args: int, order_id: int) -> None:
    _count("takes_varargs")


@task
def takes_anything(order_id: int, **options: object) -> None:
    _count("takes_anything")


@dataclass
class Greeter:
    """A callable object as a handler; a dataclass instance, so it cannot be hashed."""

    greeting: str

    def __call__(self, name: str) -> None:
        _count(f"{self.greeting} {name}")


greet = task(name="tests.tasks.greet")(Greeter("hello"))


def logged(func: Callable[..., None]) -> Callable[..., None]:
    """A decorator as people write them: (*args, **kwargs), with functools.wraps."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        func(*args, **kwargs)

    return wrapper


@task
@logged
def decorated(order_id: int) -> None:
    _count("decorated")


# The chaos suite's tasks and the crash tests' hostile handlers live in their own modules;
# importing them here registers them (only installed apps' `tasks` modules are autodiscovered).
from tests import hostile as hostile_tasks  # noqa: E402, F401
from tests import process_tasks  # noqa: E402, F401
from tests.chaos import tasks as chaos_tasks  # noqa: E402, F401


@task
def reports_progress(steps: int, pause: float = 0.0) -> None:
    """Reports step 1, 2, ... of `steps`, `pause` seconds apart: the progress tests' handler."""
    import time

    from django_pgjobs import progress

    for step in range(1, steps + 1):
        progress(step, steps, note=f"step {step} of {steps}")
        time.sleep(pause)


@task
async def reports_progress_async(steps: int) -> None:
    """reports_progress for an async def handler: its coroutine reports for its job."""
    from django_pgjobs import progress

    for step in range(1, steps + 1):
        await asyncio.sleep(0)
        progress(step, steps, note=f"async step {step}")


@task(max_attempts=5)
def ledger(n: int, seconds: float = 0.0) -> None:
    """One ledger row per run (ChaosExecution: job, attempt, worker), then take `seconds`: the
    NATS tests' handler."""
    import os
    import time

    from django_pgjobs import current_job
    from tests.models import ChaosExecution

    job = current_job()
    assert job is not None
    ChaosExecution.objects.create(
        job_id=job.pk, attempt=job.attempts, worker=job.worker, pid=os.getpid(), ok=True
    )
    time.sleep(seconds)


@task(max_attempts=3)
def fails_and_counts() -> None:
    _count("fails_and_counts")
    raise RuntimeError("boom")


seen_headers: list[object] = []


@task
def reports_its_headers() -> None:
    from django_pgjobs import current_job

    job = current_job()
    assert job is not None
    seen_headers.append((job.pk, job.attempts, job.headers))


failed_at: list[float] = []


@task(max_attempts=3, backoff=lambda attempts: 0.4)
def fails_after_a_pause() -> None:
    """Fails every attempt, noting when; retried after 0.4 s."""
    import time

    failed_at.append(time.monotonic())
    raise RuntimeError("not yet")


@task(timeout=2, max_attempts=2, backoff=lambda attempts: 0.0)
def overruns_then_retries_quietly(seconds: float) -> None:
    """Attempt 1 passes its time limit and goes on reporting, every 10 ms for 10 seconds,
    abandoned; attempt 2 reports nothing and returns after `seconds`."""
    import time

    from django_pgjobs import current_job, progress

    job = current_job()
    assert job is not None
    if job.attempts > 1:
        time.sleep(seconds)
        return
    until = time.monotonic() + 10
    while (now := time.monotonic()) < until:
        progress(round(now, 2), note="attempt 1, past its time limit")
        time.sleep(0.01)


frozen_while_running: list[int] = []


@task
def counts_frozen() -> None:
    """Notes how many objects the collector leaves out of its passes (see Worker.run)."""
    import gc

    frozen_while_running.append(gc.get_freeze_count())


@task(timeout=30)
def quick_with_a_time_limit() -> None:
    """Returns at once, well within its time limit."""


# ---- batches and dependencies (tests/*/test_batches*.py) ----------------------------------------


@task(queue="batches", max_attempts=2, backoff=lambda attempt: 0)
def part(n: int, fail: bool = False) -> int:
    """A member of a batch: a dead letter at once when told to fail."""
    if fail:
        raise PermanentError(f"part {n} failed")
    return n


@task(queue="batches")
def batch_done(batch: dict[str, Any], **payload: Any) -> None:
    """A batch's callback: what it got is its job's payload."""


@task(queue="batches")
def step(name: str, fail: bool = False) -> str:
    """A job of a chain (after=)."""
    if fail:
        raise PermanentError(f"step {name} failed")
    return name


@task(queue="batches")
def mail(batch: dict[str, Any], name: str) -> None:
    """Another batch's callback."""


@task(queue="batches")
def slow_step(name: str, seconds: float = 0.0, fail: bool = False) -> str:
    """A job of a chain (after=) that takes `seconds` (tests/crash/test_batches_processes.py)."""
    import time

    time.sleep(seconds)
    if fail:
        raise PermanentError(f"step {name} failed")
    return name
