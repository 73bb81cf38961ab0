"""`async def` handlers (runtime/execute.py) in process: cancellation asked for and at a time
limit, tasks a coroutine leaves behind, an error's traceback, a companion thread that fails."""

from __future__ import annotations

import threading

import pytest
from django.db import InterfaceError

from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled
from django_pgjobs.runtime import execute
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until


@pytest.mark.django_db(transaction=True)  # the check asks from a thread of its own
def test_cancel_requested_works_in_an_async_handler():
    Job.objects.enqueue("tests.hostile.checks_for_cancellation_asynchronously")
    (job,) = Job.objects.claim(["default"], worker="w1")
    Job.objects.filter(pk=job.pk).cancel()

    handled = execute.run(job)

    assert handled.failure is not None
    assert handled.failure.type == "django_pgjobs.errors.JobCancelled", handled.failure


@pytest.fixture
def stubborn_tasks_ended():
    from tests import hostile

    hostile.stubborn_tasks_end.clear()
    yield
    hostile.stubborn_tasks_end.set()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stubborn_tasks_ended")
def test_an_async_handler_leaving_a_task_that_ignores_cancellation_has_its_own_outcome(caplog):
    # asyncio.run cancels the tasks a coroutine left and waits for them to end: the handler
    # thread waited for good, the job stayed running (or was recorded as timed out under a time
    # limit) and the jobs behind it waited for that thread.
    stubborn = Job.objects.enqueue("tests.hostile.leaves_a_task_that_ignores_cancellation")
    after = [Job.objects.enqueue("tests.hostile.checks_for_cancellation_asynchronously")]
    after += [Job.objects.enqueue("tests.tasks.noop") for _ in range(3)]
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(
            lambda: set(Job.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}, 20
        )
        assert not worker._stopping  # one companion thread left: fewer than the two threads
    finally:
        worker.stop()
        thread.join(10)
    assert "leaving tasks that did not end within" in caplog.text
    assert str(stubborn.pk) in caplog.text
    assert Job.objects.get(pk=stubborn.pk).attempts == 1


@pytest.mark.django_db(transaction=True)
def test_an_async_handlers_error_has_the_traceback_of_its_coroutine_not_of_two_threads():
    # Raised again in the companion thread, the same exception object collected that thread's
    # frames as well as the handler thread's: a traceback interleaving both.
    Job.objects.enqueue("tests.hostile.raises_in_its_coroutine")
    (job,) = Job.objects.claim(["default"], worker="w1")
    handled = execute.run(job)
    assert handled.failure is not None
    trace = handled.failure.traceback
    assert trace.rstrip().endswith("ValueError: raised in the coroutine"), trace
    assert "in raises_in_its_coroutine" in trace
    assert "in _serve" not in trace and "base_events.py" not in trace, trace


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_whose_companion_fails_before_its_coroutine_still_ends(monkeypatch):
    # Its companion thread's look at its connections raised before the coroutine ran: the
    # companion ended, the answer never came, and the handler thread waited on it for good.
    def unusable() -> None:
        raise InterfaceError("connection already closed")

    monkeypatch.setattr(execute, "close_old_connections", unusable)
    Job.objects.enqueue("tests.tasks.async_noop", {"value": 1})
    (job,) = Job.objects.claim(["default"], worker="w1")
    handled: list[Handled] = []

    def handler_thread() -> None:
        handled.append(execute.run(job))
        execute.release_awaiter()  # as a handler thread does when it ends

    thread = threading.Thread(target=handler_thread, daemon=True)
    thread.start()
    thread.join(10)
    assert handled and handled[0].failure is not None
    assert handled[0].failure.type.endswith("InterfaceError")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stubborn_tasks_ended")
def test_an_async_handlers_leftovers_recycle_the_worker_once_they_pile_up():
    # Like threads abandoned past their time limits: each left companion holds a thread, its
    # event loop and maybe a connection; as many as the worker has threads and it is replaced.
    for _ in range(2):
        Job.objects.enqueue("tests.hostile.leaves_a_task_that_ignores_cancellation")
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True))
    assert worker.run() == Exit.RECYCLE
    assert list(Job.objects.values_list("status", flat=True)) == [Status.SUCCEEDED] * 2


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_past_its_time_limit_is_cancelled_and_its_thread_ends():
    # A thread cannot be stopped, a coroutine can: its attempt recorded as timed out, the
    # coroutine awaited on for its whole minute, and its abandoned handler thread with it.
    from tests import hostile

    hostile.async_time_limit_seen.clear()
    job = Job.objects.enqueue("tests.hostile.awaits_past_its_time_limit")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.FAILED, 10)
        wait_until(lambda: hostile.async_time_limit_seen == ["cancelled"], 5)
        wait_until(lambda: worker.handlers.deadlines.abandoned_alive() == 0, 5)
    finally:
        worker.stop()
        thread.join(10)
    assert Job.objects.get(pk=job.pk).errors[-1]["type"].endswith("JobTimeout")


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_cancelled_inside_a_sync_call_is_said_to_be_so(caplog):
    # The line said the handler "returned, leaving tasks" and that the outcome was the
    # handler's; it was cancelled, the call runs on, and the outcome is the time limit's.
    job = Job.objects.enqueue("tests.hostile.awaits_a_slow_sync_call_past_its_time_limit")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: "was cancelled at its time limit" in caplog.text, 15)
    finally:
        worker.stop()
        thread.join(10)
    assert str(job.pk) in caplog.text and "returned, leaving tasks" not in caplog.text
    assert Job.objects.get(pk=job.pk).errors[-1]["type"].endswith("JobTimeout")
