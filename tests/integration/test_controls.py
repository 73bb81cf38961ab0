"""Cancellation of running jobs, paused and limited queues, the workers' statistics and the
lifecycle signals — in process, against the real database."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection

from django_pgjobs import signals
from django_pgjobs.data.records import Failure
from django_pgjobs.models import LATENCY_BUCKETS, Job, Queue, QueueStat
from django_pgjobs.runtime import execute
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


def claim(worker: str = "w1", limit: int = 1, queues: tuple[str, ...] = ("default",)) -> list[Job]:
    return Job.objects.claim(list(queues), worker=worker, limit=limit)


def status_of(job: Job) -> str:
    return Job.objects.get(pk=job.pk).status


# ---- cancellation ---------------------------------------------------------------------------


def test_cancel_cancels_ready_jobs_and_flags_running_ones_only():
    JobFactory()
    (running,) = claim()
    ready, done = JobFactory(), JobFactory(succeeded=True)
    changed = Job.objects.filter(pk__in=[ready.pk, running.pk, done.pk]).cancel()
    assert set(changed) == {ready.pk, running.pk}
    assert status_of(ready) == Status.CANCELLED
    row = Job.objects.get(pk=running.pk)
    assert (row.status, row.cancel_requested, row.finished_at) == (Status.RUNNING, True, None)
    assert status_of(done) == Status.SUCCEEDED
    # Asking again changes nothing: the request is already there.
    assert Job.objects.filter(pk=running.pk).cancel() == []


@pytest.mark.parametrize(
    "finish",
    [
        lambda job: Job.objects.fail(job, Failure("RuntimeError", "x"), permanent=False, delay=0),
        lambda job: Job.objects.retry_later(job, 0),
        lambda job: Job.objects.release([job]),
    ],
    ids=["failed attempt", "retry asked", "released at shutdown"],
)
def test_a_running_job_asked_to_cancel_ends_cancelled_not_retried(finish):
    JobFactory()
    (job,) = claim()
    Job.objects.filter(pk=job.pk).cancel()
    finish(job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.cancel_requested) == (Status.CANCELLED, True)
    assert row.finished_at is not None


def test_a_job_asked_to_cancel_whose_worker_died_is_cancelled_by_the_reaper():
    JobFactory(expired=True, cancel_requested=True)
    assert Job.objects.reap()[:2] == (0, 0)
    assert Job.objects.get().status == Status.CANCELLED


def test_a_job_asked_to_cancel_that_still_succeeds_is_recorded_as_succeeded():
    JobFactory()
    (job,) = claim()
    Job.objects.filter(pk=job.pk).cancel()
    assert Job.objects.complete(job)
    assert status_of(job) == Status.SUCCEEDED


def test_heartbeats_bring_the_request_to_the_running_job():
    JobFactory()
    (job,) = claim()
    assert not job.cancel_requested
    Job.objects.filter(pk=job.pk).cancel()
    assert Job.objects.heartbeat([job]) == {job.pk}
    assert job.cancel_requested


def test_a_handler_observes_the_request_and_the_job_is_recorded_cancelled():
    Job.objects.enqueue("tests.tasks.until_cancelled", {"n": 7, "timeout": 5})
    (job,) = claim()
    Job.objects.filter(pk=job.pk).cancel()
    outcome = execute.run(job)
    assert outcome.failure is not None and outcome.failure.type.endswith("JobCancelled")
    execute.settle(job, outcome)
    row = Job.objects.get(pk=job.pk)
    assert row.status == Status.CANCELLED
    assert row.errors[-1]["message"] == "stopped on request"


def test_replay_of_a_cancelled_job_clears_the_request():
    JobFactory()
    (job,) = claim()
    Job.objects.filter(pk=job.pk).cancel()
    Job.objects.release([job])
    assert Job.objects.filter(pk=job.pk).replay() == [job.pk]
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.cancel_requested) == (Status.READY, False)


@pytest.mark.django_db(transaction=True)
def test_a_job_cancelled_while_it_waits_for_a_thread_is_not_started():
    # Claimed and waiting behind a slow job (prefetch, a turn's batch), it showed as running: the
    # operator's cancel was told "running ones stop if their handler checks", and the handler,
    # started after the cancel had committed, ran in full.
    from tests.models import Execution

    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 0.8}, priority=10)
    waiting = Job.objects.enqueue("tests.tasks.record", {"n": 2})
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    worker.learn_durations([0.001] * 10)  # fast handlers so far: it claims beyond its thread
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=10)
        assert Job.objects.get(pk=waiting.pk).status == Status.RUNNING  # claimed, not started
        assert Job.objects.filter(pk=waiting.pk).cancel() == [waiting.pk]
        wait_until(lambda: Job.objects.get(pk=waiting.pk).status == Status.CANCELLED, timeout=10)
    finally:
        worker.stop()
        thread.join(15)
    assert not Execution.objects.filter(n=2).exists()
    assert Job.objects.get(pk=slow.pk).status == Status.SUCCEEDED


# ---- queue controls -------------------------------------------------------------------------


def test_claim_limited_claims_nothing_from_a_paused_queue():
    Queue.objects.create(name="default", paused=True)
    JobFactory.create_batch(3)
    assert Job.objects.claim_limited("default", worker="w1", limit=3).claimed == []


def test_claim_limited_takes_only_the_room_left_under_max_running():
    Queue.objects.create(name="default", max_running=3)
    JobFactory.create_batch(6)
    assert len(claim(limit=1)) == 1  # one running already, claimed by anyone
    assert len(Job.objects.claim_limited("default", worker="w1", limit=10).claimed) == 2
    assert Job.objects.claim_limited("default", worker="w2", limit=10).claimed == []


def test_claim_limited_on_a_queue_without_controls_is_a_plain_claim():
    JobFactory.create_batch(3)
    assert len(Job.objects.claim_limited("default", worker="w1", limit=2).claimed) == 2


def runjobs_once(*queues: str) -> None:
    args = [arg for queue in queues for arg in ("--queue", queue)]
    call_command("runjobs", "--once", *args, verbosity=0)


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_a_worker_leaves_a_paused_queue_alone_and_serves_the_others():
    Queue.objects.create(name="default", paused=True)
    paused = JobFactory.create_batch(3)
    other = JobFactory(queue="emails", task="tests.tasks.send_email", payload={"to": "a@b.c"})
    runjobs_once("default", "emails")
    assert {status_of(job) for job in paused} == {Status.READY}
    assert status_of(other) == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_a_worker_runs_a_limited_queue_within_its_limit():
    Queue.objects.create(name="default", max_running=2)
    jobs = JobFactory.create_batch(5)
    runjobs_once("default")
    assert {status_of(job) for job in jobs} == {Status.SUCCEEDED}


# ---- what workers report --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_a_worker_writes_its_counts_and_claim_latencies_per_queue():
    JobFactory.create_batch(4)
    JobFactory(task="tests.tasks.fails_permanently")
    runjobs_once("default", "idle")
    rows = {row.queue: row for row in QueueStat.objects.filter(seconds__gt=0)}
    assert set(rows) == {"default", "idle"}  # idle queues are reported too
    # Then a row of no time per queue served: the worker says it stopped.
    goodbye = QueueStat.objects.filter(seconds=0)
    assert sorted(goodbye.values_list("queue", "claimed", "succeeded")) == [
        ("default", 0, 0),
        ("idle", 0, 0),
    ]
    busy = rows["default"]
    assert (busy.claimed, busy.succeeded, busy.retried, busy.failed) == (5, 4, 0, 1)
    assert len(busy.latency_buckets) == len(LATENCY_BUCKETS) + 1
    assert sum(busy.latency_buckets) == 5
    assert busy.seconds > 0 and busy.worker
    assert (rows["idle"].claimed, sum(rows["idle"].latency_buckets)) == (0, 0)


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every lifecycle signal sent, as (name, arguments), while the test runs."""
    names = ["job_enqueued", "job_started", "job_succeeded", "job_retried", "job_failed"]
    log: list[tuple[str, dict[str, Any]]] = []
    receivers = []
    for name in names:

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            log.append((name, kwargs))

        getattr(signals, name).connect(receiver, weak=False)
        receivers.append((name, receiver))
    yield log
    for name, receiver in receivers:
        getattr(signals, name).disconnect(receiver)


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_lifecycle_signals_carry_the_job_its_duration_and_its_error(received, settings):
    good = Job.objects.enqueue("tests.tasks.noop")
    bad = Job.objects.enqueue("tests.tasks.always_fails", max_attempts=2)
    dead = Job.objects.enqueue("tests.tasks.fails_permanently")
    runjobs_once("default")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, kwargs in received:
        by_name.setdefault(name, []).append(kwargs)
    assert [len(kwargs["jobs"]) for kwargs in by_name["job_enqueued"]] == [1, 1, 1]
    assert {kwargs["job"].pk for kwargs in by_name["job_started"]} == {good.pk, bad.pk, dead.pk}
    (succeeded,) = by_name["job_succeeded"]
    assert succeeded["job"].pk == good.pk and 0 < succeeded["duration"] < 10
    (retried,) = by_name["job_retried"]
    assert retried["job"].pk == bad.pk and retried["error"].type == "RuntimeError"
    # The backoff's full jitter: anywhere in the first attempt's window, [0, BACKOFF_BASE].
    assert 0 <= retried["delay"] <= settings.PGJOBS["BACKOFF_BASE"]
    failed = {kwargs["job"].pk: kwargs["error"] for kwargs in by_name["job_failed"]}
    assert set(failed) == {bad.pk, dead.pk}
    assert "bad data" in failed[dead.pk].message


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_a_receiver_that_raises_breaks_neither_enqueue_nor_the_worker(caplog):
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.job_enqueued.connect(broken, weak=False)
    signals.job_succeeded.connect(broken, weak=False)
    try:
        job = Job.objects.enqueue("tests.tasks.noop")
        runjobs_once("default")
    finally:
        signals.job_enqueued.disconnect(broken)
        signals.job_succeeded.disconnect(broken)
    assert status_of(job) == Status.SUCCEEDED
    assert "receiver bug" in caplog.text


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_a_limited_queue_whose_row_is_locked_elsewhere_is_passed_over_not_waited_for(
    other_connection,
):
    # The session holding the queue's row may be a worker stopped in the middle of its claim
    # (SIGSTOP, a frozen VM) or an operator's open transaction: every other worker's turn waited
    # its lock_timeout on it and failed whole, claiming from no queue and recording nothing.
    Queue.objects.create(name="default", max_running=50)
    limited = JobFactory.create_batch(2)
    other = JobFactory(queue="emails", task="tests.tasks.send_email", payload={"to": "a@b.c"})
    with connection.cursor() as cursor:  # this session's wait, should there be one, fails
        cursor.execute("SET lock_timeout = '2s'")
    with other_connection.transaction():
        other_connection.execute("SELECT FROM pgjobs_queue WHERE name = 'default' FOR UPDATE")
        assert Job.objects.claim_limited("default", worker="w1", limit=5).claimed == []
        runjobs_once("default", "emails")
    assert status_of(other) == Status.SUCCEEDED
    assert {status_of(job) for job in limited} == {Status.READY}
    runjobs_once("default")  # the lock gone, the queue is served again
    assert {status_of(job) for job in limited} == {Status.SUCCEEDED}
