"""PgJobsBackend against the contract of Django's Tasks framework.

Modelled on the framework's own backend tests (enqueue, results, refresh, run_after, priority,
queues, failures, context, signals, rows that must not run), with our guarantees on top:
enqueue in the caller's transaction, retries when the backend's OPTIONS ask for them, and
workers that only ever run Tasks of this backend.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_pgjobs import registry
from django_pgjobs.backend import PgJobsBackend, WorkerLost
from django_pgjobs.errors import EnqueueError, PermanentError
from django_pgjobs.models import Job
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import framework_tasks as tasks
from tests.conftest import wait_until
from tests.factories import JobFactory
from tests.integration.test_read_replicas import ReadReplicaRouter, replica  # noqa: F401

try:
    from django.tasks import TaskResultStatus, default_task_backend, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:
    from django_tasks import TaskResultStatus, default_task_backend, task_backends
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started

pytestmark = pytest.mark.django_db

PREFIX = registry.DJANGO_TASK_PREFIX


def job_of(result: Any) -> Job:
    return Job.objects.get(pk=result.id)


@pytest.fixture
def signals() -> Iterator[list[tuple[str, str, Any]]]:
    """(signal, status, task_result) for each task signal sent, in order."""
    sent: list[tuple[str, str, Any]] = []
    receivers = {}
    for name, sig in [
        ("enqueued", task_enqueued),
        ("started", task_started),
        ("finished", task_finished),
    ]:

        def receiver(sender: Any, task_result: Any, name: str = name, **kwargs: Any) -> None:
            assert sender is PgJobsBackend
            sent.append((name, str(task_result.status), task_result))

        sig.connect(receiver)
        receivers[sig] = receiver
    yield sent
    for sig, receiver in receivers.items():
        sig.disconnect(receiver)


# ---- configuration -------------------------------------------------------------------------


def test_the_configured_backend_is_ours_and_supports_everything_the_framework_offers():
    backend = task_backends["default"]

    assert default_task_backend.alias == "default"
    assert isinstance(backend, PgJobsBackend)
    assert (
        backend.supports_defer,
        backend.supports_async_task,
        backend.supports_get_result,
        backend.supports_priority,
    ) == (True, True, True, True)
    assert backend.check() == []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"OPTIONS": {"max_attempt": 3}}, "unknown keys ['max_attempt']"),
        (
            {"OPTIONS": {"max_attempts": 0}},
            "max_attempts=0 must be an integer from 1 to 2147483647",
        ),
        ({"QUEUES": ["default", "bad queue"]}, "queue='bad queue' is not a valid queue name"),
    ],
)
def test_a_misconfigured_backend_says_what_is_wrong(params, message):
    with pytest.raises(ImproperlyConfigured, match=message.replace("[", r"\[")):
        PgJobsBackend("broken", {"BACKEND": "django_pgjobs.backend.PgJobsBackend", **params})


def test_the_check_says_a_tasks_results_are_not_kept_on_a_nats_queue(settings):
    # get_result() of a Task that succeeded on a NATS queue raised TaskResultDoesNotExist, and
    # nothing had said so.
    settings.PGJOBS = {**settings.PGJOBS, "QUEUES": {"jetstream": {"TRANSPORT": "nats"}}}
    backend = PgJobsBackend(
        "mixed", {"BACKEND": "django_pgjobs.backend.PgJobsBackend", "QUEUES": ["a", "jetstream"]}
    )
    [warning] = backend.check()
    assert warning.id == "pgjobs.W042" and "'jetstream'" in warning.msg
    plain = PgJobsBackend("plain", {"BACKEND": "django_pgjobs.backend.PgJobsBackend"})
    assert plain.check() == []


def test_the_check_asks_for_django_pgjobs_in_installed_apps(settings):
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "django_pgjobs"]

    errors = task_backends["default"].check()

    assert [error.id for error in errors] == ["pgjobs.E002"]
    assert "INSTALLED_APPS" in errors[0].hint


# ---- enqueue -------------------------------------------------------------------------------


@pytest.mark.parametrize("task", [tasks.noop, tasks.noop_async])
def test_enqueue_writes_one_job_and_returns_a_ready_result(task, django_assert_num_queries):
    with django_assert_num_queries(1):
        result = task.enqueue(1, two=3)

    assert result.status == TaskResultStatus.READY
    assert (result.started_at, result.finished_at, result.last_attempted_at) == (None, None, None)
    assert result.enqueued_at is not None and result.enqueued_at <= timezone.now()
    assert (result.task, result.args, result.kwargs, result.backend) == (
        task,
        [1],
        {"two": 3},
        "default",
    )
    assert (result.errors, result.worker_ids, result.attempts, result.is_finished) == (
        [],
        [],
        0,
        False,
    )
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018
    job = job_of(result)
    assert (job.task, job.queue, job.priority, job.status, job.max_attempts) == (
        PREFIX + task.module_path,
        "default",
        0,
        Status.READY,
        1,
    )
    assert job.payload == {"args": [1], "kwargs": {"two": 3}, "backend": "default"}


def test_aenqueue_and_aget_result_work_from_async_code():
    result = async_to_sync(tasks.noop.aenqueue)("a", b=2)
    fetched = async_to_sync(tasks.noop.aget_result)(result.id)

    assert fetched == result
    assert job_of(result).payload["kwargs"] == {"b": 2}


def test_tuples_become_lists_as_the_framework_normalises_them():
    result = tasks.noop.enqueue((1, 2), pair=(3, (4, 5)))

    assert (result.args, result.kwargs) == ([[1, 2]], {"pair": [3, [4, 5]]})
    assert tasks.noop.get_result(result.id) == result


def test_priority_queue_and_run_after_are_written_to_the_job():
    run_after = timezone.now() + timedelta(hours=10)

    result = tasks.important.using(run_after=run_after).enqueue(n=1)

    job = job_of(result)
    assert (job.priority, job.queue, job.run_at) == (10, "queue-1", run_after)
    assert result.task.run_after == run_after
    assert tasks.important.get_result(result.id) == result


@pytest.mark.parametrize(
    ("make_task", "error", "message"),
    [
        (lambda: tasks.noop.using(queue_name="elsewhere"), InvalidTask, "Queue 'elsewhere'"),
        (lambda: tasks.noop.using(priority=101), InvalidTask, "priority must be"),
        (
            lambda: tasks.noop.using(run_after=timezone.now().replace(tzinfo=None)),
            InvalidTask,
            "aware datetime",
        ),
    ],
)
def test_tasks_the_backend_cannot_run_are_refused_when_they_are_made(make_task, error, message):
    with pytest.raises(error, match=message):
        make_task()


@pytest.mark.parametrize(
    ("args", "kwargs", "message", "a_type_error"),
    [
        ((timezone.now(),), {}, r"payload\['args'\]\[0\] is a datetime", True),
        (
            (),
            {"when": {"at": object()}},
            r"payload\['kwargs'\]\['when'\]\['at'\] is a object",
            True,
        ),
        (({1, 2},), {}, r"payload\['args'\]\[0\] is a set", True),
        ((Decimal("1.5"),), {}, r"payload\['args'\]\[0\] is a Decimal", True),
        # Values of JSON's types: the framework raises no TypeError for them either.
        ((float("nan"),), {}, "which JSON cannot represent", False),
        (("a\x00b",), {}, "NUL character", False),
        ((b"\xff",), {}, "is a bytes", False),
    ],
)
def test_arguments_that_do_not_survive_json_are_refused_naming_where_they_are(
    args, kwargs, message, a_type_error
):
    with pytest.raises(EnqueueError, match=message) as raised:
        tasks.noop.enqueue(*args, **kwargs)

    assert str(raised.value).startswith("tests.framework_tasks.noop: ")
    # As the framework's own backends raise it: code that catches TypeError catches it.
    assert isinstance(raised.value, TypeError) is a_type_error
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_enqueue_is_part_of_the_callers_transaction(other_connection):
    def jobs_seen_by_others() -> int:
        with other_connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pgjobs_job")
            return int(cursor.fetchone()[0])

    with transaction.atomic():
        result = tasks.noop.enqueue()
        # Written now (enqueued_at is set), visible to workers when the transaction commits.
        assert result.enqueued_at is not None
        assert jobs_seen_by_others() == 0
    assert jobs_seen_by_others() == 1

    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.noop.enqueue()
        raise RuntimeError("the view failed")
    assert jobs_seen_by_others() == 1


def test_task_enqueued_is_sent_with_the_ready_result(signals):
    result = tasks.noop.enqueue()

    assert signals == [("enqueued", "READY", result)]


# ---- results -------------------------------------------------------------------------------


def test_get_result_reads_the_same_result_in_one_query(django_assert_num_queries):
    result = default_task_backend.enqueue(tasks.calculate_meaning_of_life, [], {})

    with django_assert_num_queries(1):
        fetched = default_task_backend.get_result(result.id)

    assert fetched == result


def test_refresh_reads_the_status_the_worker_wrote():
    result = tasks.calculate_meaning_of_life.enqueue()
    run_jobs()

    assert result.status == TaskResultStatus.READY
    result.refresh()

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert result.attempts == 1


def test_arefresh_works_from_async_code():
    result = tasks.calculate_meaning_of_life.enqueue()
    run_jobs()

    async_to_sync(result.arefresh)()

    assert result.return_value == 42


# A fixed UUID that no job has: test ids must be the same in every pytest-xdist process.
@pytest.mark.parametrize("result_id", ["123", "0190d5a4-4b7e-7c3a-9f1e-2a6b8c0d4e5f", ""])
def test_a_missing_or_malformed_id_is_a_result_that_does_not_exist(result_id):
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result_id)
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(default_task_backend.aget_result)(result_id)


def test_plain_jobs_and_other_aliases_results_are_not_this_backends_results():
    plain = JobFactory()
    other = tasks.succeeds_on_the_third_attempt.enqueue()  # the "retrying" alias

    for result_id in [str(plain.pk), other.id]:
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(result_id)
    assert task_backends["retrying"].get_result(other.id) == other


def test_a_tasks_get_result_refuses_the_result_of_another_task():
    result = tasks.noop.enqueue()

    with pytest.raises(TaskResultMismatch):
        tasks.calculate_meaning_of_life.get_result(result.id)


def test_a_cancelled_job_is_a_failed_result():
    result = tasks.noop.enqueue()
    Job.objects.filter(pk=result.id).cancel()

    result.refresh()

    assert result.status == TaskResultStatus.FAILED
    assert result.is_finished and result.finished_at is not None


def test_a_job_whose_lease_expired_shows_the_lost_worker_as_an_error():
    result = tasks.noop.enqueue()
    Job.objects.claim(["default"], worker="w1", lease=0)
    Job.objects.reap()

    result.refresh()

    assert result.status == TaskResultStatus.FAILED  # max_attempts 1: no attempt left
    assert [error.exception_class for error in result.errors] == [WorkerLost]
    assert result.worker_ids == ["w1"]


def test_the_admin_lists_and_shows_a_tasks_job_with_its_name_and_arguments(admin_client):
    result = tasks.noop.enqueue("<b>x</b>", n=1)
    name = PREFIX + "tests.framework_tasks.noop"

    listed = admin_client.get(reverse("admin:pgjobs_job_changelist"), {"task": name})
    detail = admin_client.get(reverse("admin:pgjobs_job_change", args=[result.id]))

    assert [str(job.pk) for job in listed.context["cl"].result_list] == [result.id]
    page = detail.content.decode()
    assert name in page
    assert "&quot;&lt;b&gt;x&lt;/b&gt;&quot;" in page  # the arguments, escaped
    assert "&quot;backend&quot;: &quot;default&quot;" in page


# ---- running -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "args", "value"),
    [
        (tasks.calculate_meaning_of_life, (), 42),
        (tasks.add_async, (2, 3), 5),
        (tasks.echo, ((1, "a"), b"bytes"), {"args": [[1, "a"], "bytes"], "kwargs": {}}),
    ],
)
def test_a_run_task_is_successful_and_keeps_its_return_value_as_json(task, args, value):
    result = task.enqueue(*args)

    assert len(run_jobs()) == 1

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == value
    assert job_of(result).result == value
    assert result.worker_ids == [job_of(result).worker]


def test_an_async_task_leaving_a_task_that_ignores_cancellation_keeps_its_return_value():
    # Task.call's async_to_sync waited for good for the task left running (asyncio.run cancels
    # the leftovers, then waits for each to end).
    from tests import hostile

    hostile.stubborn_tasks_end.clear()
    try:
        result = tasks.add_async_leaving_a_stubborn_task.enqueue(2, 3)
        assert len(run_jobs()) == 1
    finally:
        hostile.stubborn_tasks_end.set()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5


def test_a_task_enqueued_receiver_that_raises_does_not_undo_the_enqueue_for_its_caller(caplog):
    # The row was committed (autocommit), then the receiver's error reached the caller, who
    # took the enqueue for failed: a retry enqueued the Task twice.
    def broken(sender: Any, task_result: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    task_enqueued.connect(broken)
    try:
        result = tasks.noop.enqueue()
    finally:
        task_enqueued.disconnect(broken)
    assert job_of(result).status == Status.READY
    assert "a receiver of a task signal raised" in caplog.text


def test_a_task_outside_the_installed_apps_is_enqueued_with_a_warning_once(
    tmp_path, monkeypatch, caplog
):
    # A worker imports a Task's module only from an installed app: its jobs were dead letters
    # at their first claim, and nothing said so at enqueue.
    (tmp_path / "outside_apps.py").write_text(
        "try:\n    from django.tasks import task\n"
        "except ImportError:\n    from django_tasks import task\n\n\n"
        "@task\ndef elsewhere() -> None:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import outside_apps  # type: ignore[import-not-found]

    outside_apps.elsewhere.enqueue()
    outside_apps.elsewhere.enqueue()
    tasks.noop.enqueue()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1, said
    assert said[0].startswith("the Task outside_apps.elsewhere is defined in outside_apps")


@pytest.mark.usefixtures("replica")
def test_a_result_is_read_from_the_database_jobs_are_written_to(settings):
    # Through a router's read replica, a Task enqueued a moment ago (or in this very
    # transaction) was not there: get_result() raised TaskResultDoesNotExist.
    with transaction.atomic():
        result = tasks.noop.enqueue()
        settings.DATABASE_ROUTERS = [ReadReplicaRouter()]
        assert default_task_backend.get_result(result.id).id == result.id
        result.refresh()


def test_a_task_that_raises_fails_with_its_exception_and_traceback():
    result = tasks.failing_value_error.enqueue()

    run_jobs()

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert job_of(result).status == Status.FAILED  # max_attempts 1: no retry
    [error] = result.errors
    assert error.exception_class is ValueError
    assert error.traceback.endswith("ValueError: This task failed due to ValueError\n")
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018


def test_a_task_that_exits_fails_and_the_worker_carries_on():
    result = tasks.exit_task.enqueue()
    after = tasks.noop.enqueue()

    run_jobs()

    result.refresh()
    after.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is SystemExit
    assert after.status == TaskResultStatus.SUCCESSFUL


def test_a_return_value_that_does_not_survive_json_fails_the_task_saying_why():
    result = tasks.returns_a_datetime.enqueue()

    run_jobs()

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert "the return value is a datetime, which does not survive JSON" in (
        job_of(result).last_error
    )
    assert [error.exception_class for error in result.errors] == [TypeError]


@pytest.mark.parametrize(
    ("task", "exception_class"),
    [(tasks.returns_a_set, TypeError), (tasks.returns_nan, PermanentError)],
)
def test_a_return_value_that_does_not_survive_json_fails_for_good_as_the_framework_records_it(
    task, exception_class, signals
):
    # A TypeError for a type JSON does not have, as the framework's own backends record it;
    # never retried (its backend allows 3 attempts): the same value would come back.
    result = task.enqueue()

    run_jobs()

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert job_of(result).attempts == 1
    assert [error.exception_class for error in result.errors] == [exception_class]
    [(_, status, finished)] = [sent for sent in signals if sent[0] == "finished"]
    assert status == str(TaskResultStatus.FAILED)
    assert [error.exception_class for error in finished.errors] == [exception_class]


def test_a_task_that_takes_context_sees_its_running_result():
    result = tasks.sees_its_context.enqueue("x")

    run_jobs()

    result.refresh()
    job = job_of(result)
    assert result.return_value == {
        "attempt": 1,
        "id": result.id,
        "status": "RUNNING",
        "value": "x",
        "worker_ids": [job.worker],
    }


def test_with_max_attempts_an_exception_is_retried_and_the_errors_are_kept():
    result = tasks.succeeds_on_the_third_attempt.enqueue()

    run = run_jobs(advance=timedelta(minutes=5))  # past the retries' backoff

    assert [job.status for job in run.jobs] == ["ready", "ready", "succeeded"]
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 3
    assert [error.exception_class for error in result.errors] == [ConnectionError] * 2
    assert result.attempts == 3


def test_signals_are_sent_as_the_framework_sends_them(signals):
    ok = tasks.calculate_meaning_of_life.enqueue()
    failing = tasks.failing_value_error.enqueue()
    signals.clear()

    run_jobs()

    assert [(name, status, result.id) for name, status, result in signals] == [
        ("started", "RUNNING", ok.id),
        ("finished", "SUCCESSFUL", ok.id),
        ("started", "RUNNING", failing.id),
        ("finished", "FAILED", failing.id),
    ]
    assert signals[1][2].return_value == 42


def test_an_attempt_that_will_be_retried_sends_no_task_finished(signals):
    tasks.succeeds_on_the_third_attempt.enqueue()
    signals.clear()

    run_jobs(advance=timedelta(minutes=5))

    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("started", "RUNNING"),
        ("started", "RUNNING"),
        ("finished", "SUCCESSFUL"),
    ]


@contextmanager
def a_worker(**options: Any) -> Iterator[Worker]:
    """A worker of one thread running on a thread of the test's, stopped afterwards."""
    options = {"queues": ["default"], "concurrency": 1, "listen": False, "poll_interval": 0.1,
               **options}  # fmt: skip
    worker = Worker(Options(**options))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(10)


def worked_past_the_time_limit(signals: list[tuple[str, str, Any]], task: Any, *args: Any) -> Any:
    """Run `task` on a worker whose time limit (PGJOBS["TIMEOUT"], 0.5 s) it passes, until
    task_finished has been sent; returns its result."""
    result = task.enqueue(*args)
    signals.clear()
    with a_worker():
        wait_until(lambda: job_of(result).status == Status.FAILED, 10)
        wait_until(lambda: any(name == "finished" for name, _, _ in signals), 5)
    return result


@pytest.mark.django_db(transaction=True)
def test_a_task_past_its_time_limit_finishes_failed_once_and_not_again_when_it_returns(
    signals, settings
):
    # It sent nothing at its time limit, then SUCCESSFUL when the function returned, though its
    # result (the row) said FAILED.
    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    result = worked_past_the_time_limit(signals, tasks.returns_late, 1.5)
    time.sleep(1.5)  # the function has returned meanwhile

    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("finished", "FAILED"),
    ]
    [error] = signals[1][2].errors
    assert error.exception_class_path == "django_pgjobs.errors.JobTimeout"
    result.refresh()
    assert result.status == TaskResultStatus.FAILED


@pytest.mark.django_db(transaction=True)
def test_the_time_limits_task_finished_is_sent_while_its_jobtimeout_is_being_handled(
    signals, settings
):
    # The framework's own receiver logs FAILED with logger.exception: it logged "NoneType: None"
    # and error trackers got no exception.
    seen: list[Any] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(sys.exc_info()[1])

    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    task_finished.connect(receiver)
    try:
        worked_past_the_time_limit(signals, tasks.returns_late, 1.0)
        wait_until(lambda: seen, 5)  # the receiver after the fixture's
    finally:
        task_finished.disconnect(receiver)
    assert type(seen[0]).__name__ == "JobTimeout"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", ["default", "retrying"])
def test_receivers_that_outlast_the_time_limit_leave_the_attempt_as_they_were_told_it_ended(
    signals, settings, backend
):
    # Once the function had returned, its receivers were outside the time limit: a hung one
    # kept the job running and its thread busy for good. Then they were inside it, and a slow
    # one failed the attempt with a JobTimeout after task_finished had said SUCCESSFUL: with
    # attempts left, a Task that had succeeded ran again (three times under "retrying"), each
    # run told SUCCESSFUL, the job a dead letter whose FAILED was never told.
    from tests.models import Execution

    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    task = tasks.its_receiver_takes_a_moment.using(backend=backend)
    result = task.enqueue(seconds=0, receiver_seconds=1.5)
    signals.clear()
    with a_worker():
        # Recorded at the time limit, while the receiver still runs (its thread left to it)
        wait_until(lambda: job_of(result).status == Status.SUCCEEDED, 1.4)
        wait_until(lambda: Execution.objects.exists(), 5)
        time.sleep(1.0)  # time for a second run, were there one
    job = job_of(result)
    assert (job.status, job.attempts, job.errors) == (Status.SUCCEEDED, 1, [])
    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("finished", "SUCCESSFUL"),  # told once: by the function's return
    ]
    assert list(Execution.objects.values_list("n", flat=True)) == [1]


@pytest.mark.django_db(transaction=True)
def test_timed_out_tasks_whose_receivers_hang_recycle_the_worker_once_they_pile_up(
    signals, settings
):
    # Each timed-out Task's task_finished runs on a thread of its own, which nothing counted:
    # receivers that never return (a webhook without a timeout) piled threads and connections
    # up for good, and the worker was never replaced.
    from tests.models import Execution

    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    now = timezone.now()
    for n in range(2):  # one after the other: never two handler threads abandoned at once
        tasks.its_receiver_takes_a_moment.using(run_after=now + timedelta(seconds=n)).enqueue(
            seconds=0.55, receiver_seconds=2.5
        )
    # A second after the second time-out, both receivers' threads (the handler threads, ended
    # a moment after the limit, do not count)
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, poll_interval=0.1))
    ended: list[Exit] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    try:
        thread.join(8)
    finally:
        worker.stop()
        thread.join(10)
        # The receivers write their rows last: before the next test's
        wait_until(lambda: Execution.objects.count() == 2, 10)
    assert ended == [Exit.RECYCLE]
    assert list(Execution.objects.values_list("n", flat=True)) == [-1, -1]  # told FAILED


@pytest.mark.django_db(transaction=True)
def test_a_task_timed_out_while_its_task_started_receivers_run_does_not_begin(signals, settings):
    # task_finished said FAILED (a dead letter, to replay), then its function began anyway.
    from tests.models import Execution

    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    worked_past_the_time_limit(signals, tasks.its_start_takes_a_moment, 1.0)
    time.sleep(1.0)  # the receiver has returned meanwhile
    # The test's own receiver of task_started hears it after the slow one: FAILED came first
    assert [(name, status) for name, status, _ in signals] == [
        ("finished", "FAILED"),
        ("started", "RUNNING"),
    ]
    assert not Execution.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_task_cancelled_while_its_task_started_receivers_run_finishes_failed(signals, settings):
    # Its function did not begin, and task_finished was never sent: RUNNING for ever to its
    # listeners, though the job was final (cancelled).
    from tests.models import Execution

    settings.PGJOBS = {**settings.PGJOBS, "LEASE": 3}  # a heartbeat brings the cancel
    result = tasks.its_start_takes_a_moment.enqueue(2.0)
    signals.clear()
    with a_worker():
        wait_until(lambda: job_of(result).status == Status.RUNNING, 5)
        Job.objects.filter(pk=result.id).cancel()
        wait_until(lambda: job_of(result).status == Status.CANCELLED, 10)
        wait_until(lambda: len(signals) == 2, 5)
    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("finished", "FAILED"),
    ]
    assert not Execution.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_task_whose_receivers_outlast_a_stops_grace_is_recorded_as_told_not_released(signals):
    # Released when the grace ended, though task_finished had said SUCCESSFUL: the next worker
    # ran it again and told SUCCESSFUL again.
    from tests.models import Execution

    result = tasks.its_receiver_takes_a_moment.enqueue(seconds=0, receiver_seconds=2.0)
    signals.clear()
    with a_worker(grace=0.5):
        wait_until(lambda: job_of(result).status == Status.RUNNING, 5)
        time.sleep(0.3)
    assert job_of(result).status == Status.SUCCEEDED
    with a_worker():
        wait_until(lambda: Execution.objects.exists(), 5)  # the receiver's, once
        time.sleep(0.5)  # time for a second run, were there one
    assert list(Execution.objects.values_list("n", flat=True)) == [1]
    assert [name for name, _, _ in signals] == ["started", "finished"]


@pytest.mark.django_db(transaction=True)
def test_an_async_task_that_ignores_its_cancellation_still_finishes_failed(signals, settings):
    # Its coroutine never ends, so task_finished was never sent.
    from tests import hostile

    settings.PGJOBS = {**settings.PGJOBS, "TIMEOUT": 0.5}
    hostile.stubborn_tasks_end.clear()
    try:
        worked_past_the_time_limit(signals, tasks.ignores_its_cancellation)
    finally:
        hostile.stubborn_tasks_end.set()
    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("finished", "FAILED"),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_task_without_a_time_limit_after_a_job_with_one_on_the_same_thread_finishes(signals):
    # The thread took the Task for the job before it, and for one timed out: no task_finished.
    from tests import tasks as plain_tasks

    Job.objects.enqueue(plain_tasks.quick_with_a_time_limit, priority=10)
    result = tasks.calculate_meaning_of_life.enqueue()
    signals.clear()
    with a_worker():
        wait_until(lambda: job_of(result).status == Status.SUCCEEDED, 10)
    assert [(name, status) for name, status, _ in signals] == [
        ("started", "RUNNING"),
        ("finished", "SUCCESSFUL"),
    ]


@pytest.mark.parametrize(
    ("signal", "error"),
    [(task_started, RuntimeError("receiver bug")), (task_finished, SystemExit(7))],
    ids=["task_started raising", "task_finished raising SystemExit"],
)
def test_a_receiver_that_raises_does_not_fail_the_task(caplog, signal, error):
    def broken(**kwargs: Any) -> None:
        raise error

    signal.connect(broken)
    try:
        result = tasks.calculate_meaning_of_life.enqueue()
        run_jobs()
    finally:
        signal.disconnect(broken)

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert "a receiver of a task signal raised" in caplog.text


def test_run_after_and_priority_decide_when_and_in_which_order_tasks_run():
    later = tasks.noop.using(run_after=timezone.now() + timedelta(hours=2)).enqueue()
    low = tasks.noop.using(priority=-2).enqueue()
    high = tasks.noop.using(priority=10).enqueue()
    middle = tasks.noop.enqueue()

    ran = [str(job.pk) for job in run_jobs().jobs]

    assert ran == [high.id, middle.id, low.id]
    later.refresh()
    assert later.status == TaskResultStatus.READY


@pytest.mark.parametrize(
    ("task", "payload", "error"),
    [
        # Importable, but not a Task: a row must never run an arbitrary function.
        ("subprocess.check_output", {"args": [["true"]], "kwargs": {}}, "UnknownTask"),
        ("tests.framework_tasks.not_a_task", {"args": [], "kwargs": {}}, "UnknownTask"),
        # A Task of a backend that is not ours.
        ("tests.framework_tasks.of_another_backend", {"args": [], "kwargs": {}}, "UnknownTask"),
        # Not in an installed app, and not imported.
        ("antigravity.fly", {"args": [], "kwargs": {}}, "UnknownTask"),
        ("tests.no_such_module.task", {"args": [], "kwargs": {}}, "UnknownTask"),
        ("tests.unimportable.task", {"args": [], "kwargs": {}}, "UnknownTask"),
        # Our Task, with a payload that is not a Task's, or names an alias that is not ours.
        ("tests.framework_tasks.noop", {"to": "x"}, "PayloadMismatch"),
        ("tests.framework_tasks.noop", {"args": [], "kwargs": {}}, "PayloadMismatch"),
        (
            "tests.framework_tasks.noop",
            {"args": [], "kwargs": {}, "backend": "immediate"},
            "PayloadMismatch",
        ),
        (
            "tests.framework_tasks.calculate_meaning_of_life",
            {"args": [1], "kwargs": {}, "backend": "default"},
            "PayloadMismatch",
        ),
    ],
)
def test_a_row_that_names_no_task_of_ours_is_a_dead_letter_and_runs_nothing(task, payload, error):
    job = JobFactory(task=PREFIX + task, payload=payload)

    run = run_jobs()

    assert [j.status for j in run.jobs] == [Status.FAILED]
    job.refresh_from_db()
    assert job.errors[-1]["type"] == f"django_pgjobs.errors.{error}"


def test_a_row_naming_no_task_of_ours_saves_what_to_do_in_place_of_a_traceback():
    job = JobFactory(task=PREFIX + "tests.framework_tasks.not_a_task", payload={})

    run_jobs()

    job.refresh_from_db()
    [error] = job.errors
    assert error["type"] == "django_pgjobs.errors.UnknownTask"
    assert error["traceback"].startswith(
        f"This worker cannot run '{PREFIX}tests.framework_tasks.not_a_task': a worker runs only "
        "the Tasks of installed apps whose backend is django_pgjobs.backend.PgJobsBackend"
    )
    assert "To run the job: deploy the code that defines" in error["traceback"]
    assert "If nothing should run it any more: delete the job." in error["traceback"]


def test_without_the_tasks_framework_a_tasks_job_is_a_dead_letter_saying_what_to_install(
    monkeypatch,
):
    result = tasks.noop.enqueue()
    monkeypatch.setattr(registry, "_runners", {})  # as without the framework or the backend

    run_jobs()

    job = job_of(result)
    assert job.status == Status.FAILED
    assert "install django-pgjobs[tasks]" in job.last_error


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("signal_handlers_restored")
def test_runjobs_runs_tasks_of_the_queues_it_serves_in_its_handler_threads():
    default = tasks.calculate_meaning_of_life.enqueue()
    queue_1 = tasks.important.enqueue(n=7)
    failing = tasks.failing_value_error.enqueue()

    call_command("runjobs", "--once", "--queue", "default", verbosity=0)

    for result in (default, queue_1, failing):
        result.refresh()
    assert (default.status, default.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    assert failing.status == TaskResultStatus.FAILED
    assert queue_1.status == TaskResultStatus.READY

    call_command("runjobs", "--once", "--queue", "queue-1", verbosity=0)

    queue_1.refresh()
    assert (queue_1.status, queue_1.return_value) == (TaskResultStatus.SUCCESSFUL, 7)
    assert queue_1.worker_ids == [job_of(queue_1).worker]
    assert queue_1.worker_ids != default.worker_ids  # two runjobs processes, two workers


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("signal_handlers_restored")
@override_settings(
    TASKS={"default": {"BACKEND": "django_pgjobs.backend.PgJobsBackend", "QUEUES": []}}
)
def test_a_backend_without_queues_accepts_any_valid_queue_name():
    result = tasks.noop.using(queue_name="anything").enqueue()

    call_command("runjobs", "--once", "--queue", "anything", verbosity=0)

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_a_django_task_enqueued_in_a_batch_joins_it():
    import django_pgjobs
    from django_pgjobs.models import Batch

    with django_pgjobs.batch() as batch:
        result = tasks.noop.enqueue(1)
    assert job_of(result).batch_id == batch.id
    assert Batch.objects.get(pk=batch.id).size == 1
    run_jobs()
    assert Batch.objects.get(pk=batch.id).succeeded_at is not None
