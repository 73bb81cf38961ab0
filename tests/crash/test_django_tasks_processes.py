"""Django Tasks run by real runjobs processes, which import the Tasks' module themselves."""

from __future__ import annotations

import signal

import pytest

from django_pgjobs.backend import WorkerLost
from tests import framework_tasks as tasks
from tests.conftest import wait_until
from tests.models import Execution

try:
    from django.tasks import TaskResultStatus
except ImportError:
    from django_tasks import TaskResultStatus

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_worker_process_runs_tasks_and_their_results_are_read_back_here(start_worker):
    meaning = tasks.calculate_meaning_of_life.enqueue()
    recorded = tasks.record.enqueue(1)
    failing = tasks.failing_value_error.enqueue()

    worker = start_worker("--once", "--queue", "default")

    assert worker.wait(30) == 0
    for result in (meaning, recorded, failing):
        result.refresh()
    assert (meaning.status, meaning.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    assert recorded.return_value == worker.pid == Execution.objects.get(n=1).pid
    assert f":{worker.pid}:" in recorded.worker_ids[0]
    assert failing.status == TaskResultStatus.FAILED
    assert failing.errors[0].exception_class is ValueError


def test_a_task_whose_worker_is_killed_runs_again_after_its_lease(start_worker):
    result = tasks.record.enqueue(2, seconds=2)  # the "retrying" alias: 3 attempts
    doomed = start_worker("--lease", "1")
    wait_until(lambda: Execution.objects.filter(n=2).exists(), timeout=20)
    doomed.signal(signal.SIGKILL)
    doomed.wait(5)

    survivor = start_worker("--lease", "1")

    def finished() -> bool:
        result.refresh()
        return result.is_finished

    wait_until(finished, timeout=30)
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, survivor.pid)
    assert result.attempts == 2
    assert [error.exception_class for error in result.errors] == [WorkerLost]
    assert f":{doomed.pid}:" in result.worker_ids[0]
    assert Execution.objects.filter(n=2).count() == 2


def test_a_worker_exiting_at_a_tasks_time_limit_waits_for_its_task_finished_receivers(
    start_worker,
):
    # With one thread, the time-out abandons the worker's last thread and it exits at once to
    # be replaced: the receivers, on a daemon thread, were cut off after their first step.
    tasks.its_receiver_takes_a_moment.enqueue(seconds=30, receiver_seconds=1.0)
    worker = start_worker("--concurrency", "1", env={"PGJOBS_TEST_TIMEOUT": "0.5"})

    assert worker.wait(30) == 75  # replaced: its only thread was abandoned
    assert list(Execution.objects.values_list("n", flat=True)) == [-1]  # FAILED, told in full
