"""django_pgjobs.testing: run_jobs() and assert_enqueued(), in pytest-django tests and in
Django's TestCase (the jobs live in the test's transaction) and TransactionTestCase."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import TestCase, TransactionTestCase
from django.utils import timezone

from django_pgjobs.errors import UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.testing import (
    JobError,
    assert_enqueued,
    assert_not_enqueued,
    enqueued,
    run_jobs,
)
from tests import framework_tasks
from tests import tasks as t
from tests.factories import JobFactory
from tests.models import Execution

pytestmark = pytest.mark.django_db


# ---- run_jobs ------------------------------------------------------------------------------


def test_run_jobs_runs_what_is_due_and_says_how_each_job_ended():
    t.noop.enqueue()
    t.fails_and_waits.enqueue()
    t.fails_permanently.enqueue()

    run = run_jobs()

    assert sorted(job.task for job in run.succeeded) == ["tests.tasks.noop"]
    assert [job.task for job in run.retrying] == ["tests.tasks.fails_and_waits"]
    assert [job.task for job in run.failed] == ["tests.tasks.fails_permanently"]
    assert run.counts == {"succeeded": 1, "ready": 1, "failed": 1}
    assert "tests.tasks.noop → succeeded" in repr(run)
    assert run_jobs().jobs == []  # the retry is not due yet


def test_run_jobs_also_runs_the_jobs_that_jobs_enqueue():
    t.countdown.enqueue(n=3)

    run = run_jobs()

    assert [job.payload["n"] for job in run.jobs] == [3, 2, 1, 0]
    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 4


def test_run_jobs_uses_the_workers_claim_so_jobs_record_attempts_and_a_worker():
    job = t.noop.enqueue()

    [ran] = run_jobs().jobs

    assert ran.pk == job.pk
    assert (ran.status, ran.attempts) == (Status.SUCCEEDED, 1)
    assert ran.worker.startswith("run_jobs:") and ran.started_at is not None


def test_run_jobs_can_be_limited_to_queues_and_tasks():
    email = t.send_email.enqueue(to="a@example.com")  # queue "emails"
    noop = t.noop.enqueue()
    named = t.named.enqueue()

    assert [job.pk for job in run_jobs(queues=["emails"]).jobs] == [email.pk]
    assert [job.pk for job in run_jobs(tasks=[t.named]).jobs] == [named.pk]
    noop.refresh_from_db()
    # Claimed to make room for the wanted job, and put straight back without an attempt.
    assert (noop.status, noop.attempts) == (Status.READY, 0)
    assert [job.pk for job in run_jobs(tasks=["tests.tasks.noop"]).jobs] == [noop.pk]


def test_run_jobs_can_select_django_tasks():
    result = framework_tasks.calculate_meaning_of_life.enqueue()
    t.noop.enqueue()

    run = run_jobs(tasks=[framework_tasks.calculate_meaning_of_life])

    assert [str(job.pk) for job in run.jobs] == [result.id]
    assert run.jobs[0].result == 42


def test_advance_makes_jobs_scheduled_within_it_due_and_leaves_later_ones():
    soon = t.noop.using(delay=timedelta(minutes=30)).enqueue()
    later = t.noop.using(run_at=timezone.now() + timedelta(hours=3)).enqueue()

    assert run_jobs().jobs == []
    assert [job.pk for job in run_jobs(advance=timedelta(hours=1)).jobs] == [soon.pk]
    later.refresh_from_db()
    assert later.status == Status.READY


def test_advance_runs_retries_whose_backoff_falls_within_it():
    job = t.fails_and_waits.enqueue()  # max_attempts=3, 10 minutes between attempts

    run = run_jobs(advance=timedelta(hours=1))

    assert [ran.status for ran in run.jobs] == [Status.READY, Status.READY, Status.FAILED]
    job.refresh_from_db()
    assert (job.status, job.attempts, len(job.errors)) == (Status.FAILED, 3, 3)


def test_raise_errors_raises_with_the_traceback_after_recording_the_failure():
    job = t.fails_permanently.enqueue()

    with pytest.raises(JobError, match="PermanentError: bad data") as raised:
        run_jobs(raise_errors=True)

    assert "Traceback" in str(raised.value)
    job.refresh_from_db()
    assert job.status == Status.FAILED


def test_a_job_that_enqueues_itself_stops_at_max_jobs_and_what_is_left_stays_ready():
    t.enqueues_itself.enqueue()

    with pytest.raises(JobError, match="run_jobs ran 5 jobs and more are due"):
        run_jobs(max_jobs=5)

    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 5
    assert Job.objects.running().count() == 0
    assert Job.objects.ready().count() == 1


def test_a_job_that_breaks_the_transaction_is_rolled_back_and_the_test_goes_on():
    t.writes_then_breaks_the_transaction.enqueue(n=1)
    t.noop.enqueue()

    run = run_jobs()

    assert [job.task for job in run.succeeded] == ["tests.tasks.noop"]
    broken = [job for job in run.jobs if job.task != "tests.tasks.noop"]
    assert broken and all(job.status != Status.SUCCEEDED for job in broken)
    assert "division by zero" in broken[0].last_error
    assert Execution.objects.filter(n=1).count() == 0  # the failed attempts' writes are undone


@pytest.mark.django_db(transaction=True)
def test_outside_a_transaction_jobs_run_as_under_a_worker_writes_and_all():
    t.writes_then_breaks_the_transaction.enqueue(n=2)

    run = run_jobs()

    assert not connection.in_atomic_block
    assert run.jobs and not run.succeeded
    # Autocommit, as in a worker: each attempt's write stays although the attempt failed.
    assert Execution.objects.filter(n=2).count() == len(run.jobs)


# ---- assert_enqueued -----------------------------------------------------------------------


def test_assert_enqueued_matches_the_keys_given_and_returns_the_newest_job():
    t.send_email.enqueue(to="a@example.com", subject="first")
    newest = t.send_email.enqueue(to="a@example.com", subject="second")

    assert assert_enqueued(t.send_email, to="a@example.com") == newest
    assert assert_enqueued("tests.tasks.send_email", subject="first").payload["subject"] == "first"
    assert assert_enqueued(t.send_email) == newest
    assert len(enqueued(t.send_email, to="a@example.com")) == 2


def test_payload_keys_may_share_the_helpers_parameter_names():
    JobFactory(task="tests.tasks.noop", payload={"task": "x"})

    assert assert_enqueued(t.noop, task="x").payload == {"task": "x"}
    assert_not_enqueued(t.noop, task="y")


def test_assert_enqueued_fails_listing_what_is_enqueued():
    t.send_email.enqueue(to="a@example.com")

    with pytest.raises(AssertionError) as raised:
        assert_enqueued(t.send_email, to="b@example.com")

    message = str(raised.value)
    assert "No ready job of tests.tasks.send_email with to='b@example.com'." in message
    assert "Ready jobs (1):\n  tests.tasks.send_email {'to': 'a@example.com'} queue=emails" in (
        message
    )


def test_only_ready_jobs_count_as_enqueued():
    t.noop.enqueue()
    run_jobs()

    assert_not_enqueued(t.noop)
    with pytest.raises(AssertionError, match="No job is ready"):
        assert_enqueued(t.noop)


def test_assert_not_enqueued_fails_when_a_matching_job_is_ready():
    t.send_email.enqueue(to="a@example.com")

    assert_not_enqueued(t.send_email, to="b@example.com")
    assert_not_enqueued(t.noop)
    with pytest.raises(AssertionError, match=r"Expected no ready job .* found 1"):
        assert_not_enqueued(t.send_email)


def test_django_tasks_match_on_their_args_and_kwargs():
    framework_tasks.noop.enqueue(1, (2, 3), flag=True, name="x")

    assert_enqueued(framework_tasks.noop, 1, [2, 3])
    assert_enqueued(framework_tasks.noop, 1, (2, 3), flag=True)
    assert_enqueued(framework_tasks.noop, name="x")
    assert_not_enqueued(framework_tasks.noop, 1)
    assert_not_enqueued(framework_tasks.noop, flag=False)
    assert_not_enqueued(framework_tasks.noop_async)


def test_a_value_that_is_not_a_task_is_refused_clearly():
    with pytest.raises(UnknownTask, match="a @task function, a Django Task or a task name"):
        assert_enqueued(print)


# ---- the same in Django's TestCase and TransactionTestCase ---------------------------------


class RunJobsInATestCase(TestCase):
    def test_a_job_enqueued_in_the_tests_transaction_is_visible_and_runs(self) -> None:
        t.countdown.enqueue(n=1)
        assert_enqueued(t.countdown, n=1)

        run = run_jobs()

        assert [job.payload for job in run.jobs] == [{"n": 1}, {"n": 0}]
        assert_not_enqueued(t.countdown)

    def test_a_django_tasks_result_is_readable_after_run_jobs(self) -> None:
        result = framework_tasks.add_async.enqueue(2, 40)
        assert_enqueued(framework_tasks.add_async, 2, 40)

        run_jobs()

        result.refresh()
        assert result.return_value == 42

    def test_assert_enqueued_fails_as_a_unittest_failure(self) -> None:
        with self.assertRaises(self.failureException):  # noqa: PT027  (what unittest sees)
            assert_enqueued(t.noop)


class RunJobsInATransactionTestCase(TransactionTestCase):
    def test_jobs_run_and_commit_as_under_a_worker(self) -> None:
        t.send_email.enqueue(to="a@example.com")

        run = run_jobs(queues=["emails"])

        assert run.counts == {"succeeded": 1}
        assert Job.objects.get().status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_run_jobs_sends_the_lifecycle_signals_the_worker_sends():
    from django_pgjobs import signals

    seen: list[tuple[str, str]] = []

    def on(name: str):
        def receiver(sender, job, **kwargs):
            seen.append((name, job.task))

        return receiver

    receivers = {name: on(name) for name in ("job_started", "job_succeeded", "job_failed")}
    for name, receiver in receivers.items():
        getattr(signals, name).connect(receiver)
    try:
        Job.objects.enqueue("tests.tasks.noop")
        Job.objects.enqueue("tests.tasks.fails_permanently")
        run_jobs()
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)
    assert sorted(seen) == [
        ("job_failed", "tests.tasks.fails_permanently"),
        ("job_started", "tests.tasks.fails_permanently"),
        ("job_started", "tests.tasks.noop"),
        ("job_succeeded", "tests.tasks.noop"),
    ]


def test_run_jobs_in_a_tests_transaction_follows_up_what_the_test_did():
    """In a test's transaction nothing commits: run_jobs() sweeps what the test's enqueues and
    transitions would have followed up after their commits."""
    import django_pgjobs
    from tests import tasks

    done = tasks.step.enqueue(name="done")
    run_jobs(queues=["batches"])
    waiting = tasks.step.using(after=[done]).enqueue(name="after done")
    with django_pgjobs.batch(on_complete=tasks.batch_done):
        cancelled = tasks.part.enqueue(n=1)
    Job.objects.filter(pk=cancelled.pk).cancel()
    run_jobs(queues=["batches"])
    waiting.refresh_from_db()
    assert waiting.status == Status.SUCCEEDED
    assert Job.objects.filter(task=tasks.batch_done.name, status=Status.SUCCEEDED).count() == 1
