"""The worker loop (runtime/worker.py) with its PostgreSQL source, in process: claims are the
worker's as soon as they are made, unstarted ones go back while a slow job holds the threads,
and each outcome is recorded, dead-lettered or said to be lost: what one job's row, outcome or
report does costs no other job its own."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.db.models import F

from django_pgjobs.data.records import Failure
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until


def running(count: int) -> tuple[Worker, list[Job]]:
    """A worker (not started) and `count` no-op jobs it claimed and handed to its threads."""
    for _ in range(count):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=count, listen=False))
    worker.controls.read_if_due(worker.db)  # as its turns do first
    jobs = Job.objects.claim(["default"], worker=worker.id, limit=count)
    worker.take(jobs, count)
    return worker, jobs


@pytest.mark.django_db(transaction=True)
def test_an_outcome_the_database_refuses_is_dead_lettered_and_the_others_are_recorded():
    for _ in range(3):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=3))
    jobs = Job.objects.claim(["default"], worker=worker.id, limit=3)
    worker.take(jobs, 3)
    ok = Handled(Verdict.SUCCEEDED)
    # A delay no interval can hold, as a handler's outcome could carry before delays were
    # checked where they are made: the batch's statement fails on it.
    refused = Handled(Verdict.ERROR, delay=1e300, failure=Failure("RuntimeError", "boom"))
    for job, handled in zip(jobs, [ok, refused, ok], strict=True):
        worker.hand_in(job, handled)

    worker.settle_and_claim()

    statuses = {job.pk: Job.objects.get(pk=job.pk) for job in jobs}
    assert statuses[jobs[0].pk].status == statuses[jobs[2].pk].status == Status.SUCCEEDED
    dead = statuses[jobs[1].pk]
    assert dead.status == Status.FAILED
    assert "OutcomeRefused" in dead.last_error and "boom" not in dead.last_error
    assert not worker.claims
    assert datetime.now(UTC) > dead.finished_at


@pytest.mark.django_db
def test_claimed_jobs_are_the_workers_before_anything_else_is_done_with_them(monkeypatch):
    """Renewing the claim of a task with a longer lease may fail (the database): the jobs are
    the worker's by then, to be run and renewed, not left to run out their leases."""
    from tests.factories import JobFactory

    JobFactory(task="tests.hostile.has_a_long_lease")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False))
    (job,) = Job.objects.claim(["default"], worker=worker.id, limit=1)

    def fails(claims: list[Job]) -> set[Any]:
        raise OperationalError("the database went away")

    monkeypatch.setattr(worker.source.leases, "renew", fails)
    with pytest.raises(OperationalError):
        worker.take([job], 1)
    assert [claim.job for claim in worker.claims.all()] == [job]


@pytest.mark.django_db(transaction=True)
def test_jobs_claimed_for_threads_held_up_by_a_slow_job_go_back_for_other_workers():
    # A worker that had seen fast handlers claimed jobs beyond its threads (the prefetch); one
    # slow job then held them, unstarted and their leases renewed, while other workers idled:
    # for as long as it ran, and for good behind a handler that never returns.
    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 5.0}, priority=10)
    quick = {Job.objects.enqueue("tests.tasks.noop").pk for _ in range(20)}
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.2))
    worker.learn_durations([0.001] * 10)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(pk=slow.pk).status == Status.RUNNING, timeout=10)
        taken = wait_until(
            lambda: Job.objects.claim(["default"], worker="other", limit=50), timeout=4
        )
    finally:
        worker.stop(immediately=True)
        thread.join(15)
    assert {job.pk for job in taken} <= quick
    assert {job.attempts for job in taken} == {1}  # given back without spending an attempt


@pytest.mark.django_db(transaction=True)
def test_a_locked_row_holds_back_its_outcome_alone_under_a_shorter_statement_timeout(
    other_connection,
):
    # A project's statement_timeout below the worker's lock_timeout (5 s) cancels the turn's
    # statement first: it was taken for the network ("cannot reach the database") and the whole
    # worker stalled while the row stayed locked, no outcome recorded, no claim made.
    worker, (locked, free) = running(2)
    for job in (locked, free):
        worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '500ms'")
    try:
        with other_connection.transaction():
            other_connection.execute("SELECT FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
            worker.settle_and_claim()
            statuses = dict(Job.objects.values_list("pk", "status"))
            assert (statuses[locked.pk], statuses[free.pk]) == (Status.RUNNING, Status.SUCCEEDED)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_an_outcome_not_recorded_because_the_claim_was_lost_is_logged_with_its_job(caplog):
    # A worker stopped past its lease (SIGSTOP, a frozen VM) said only "lost=4" in its next
    # activity line: nothing named the jobs whose outcomes it could not record.
    worker, (job,) = running(1)
    Job.objects.filter(pk=job.pk).update(worker="another", claims=F("claims") + 1)  # reaped, taken
    worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    worker.settle_and_claim()
    [line] = [r for r in caplog.records if "was not recorded" in r.getMessage()]
    assert line.levelname == "WARNING"
    assert f"job {job.pk} (tests.tasks.noop): its outcome (succeeded)" in line.getMessage()


def _deeply_nested() -> list[object]:
    top: list[object] = []
    inner = top
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    return top


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "report",
    [
        {"done": 1, "total": 2, "note": "a\x00b"},  # json.dumps takes it, jsonb does not
        {"done": 1, "total": 2, "note": "\ud800"},
        {"done": 1, "total": 2, "note": _deeply_nested()},  # RecursionError
        {"done": float("nan")},
        {"done": 1, "total": 2, "note": "x" * 100_000},
    ],
    ids=["NUL", "lone surrogate", "deep", "NaN", "huge"],
)
def test_a_progress_report_set_by_hand_that_jsonb_refuses_costs_no_outcome(report):
    # Set by hand on current_job().progress, it went into the turn's batch and every fallback:
    # the worker retried the batch as an outage for good (NUL) or dropped its outcomes and
    # claimed nothing more (deep nesting), and the heartbeats carrying it failed too.
    worker, (poisoned, other) = running(2)
    poisoned.progress = report
    assert worker.source.leases.renew([poisoned, other]) == {poisoned.pk, other.pk}
    for job in (poisoned, other):
        worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    worker.settle_and_claim()
    assert set(Job.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}
    assert not worker.claims


@pytest.mark.django_db(transaction=True)
def test_outcomes_a_turn_recorded_are_accounted_for_when_its_claims_cannot_be_read():
    # A Job model signal's receiver raised while the turn's claimed rows became Job objects:
    # the claims were given back, but the outcomes the same statement had recorded were never
    # accounted for: their slots stayed taken for good and the lease keeper called them lost.
    from django.db.models.signals import post_init

    worker, (done,) = running(1)
    waiting = Job.objects.enqueue("tests.tasks.noop")
    worker.hand_in(done, Handled(Verdict.SUCCEEDED))

    def broken(sender: object, **kwargs: object) -> None:
        raise RuntimeError("post_init receiver bug")

    post_init.connect(broken, sender=Job)
    try:
        with pytest.raises(RuntimeError, match="post_init receiver bug"):
            worker.settle_and_claim()
    finally:
        post_init.disconnect(broken, sender=Job)
    assert not worker.claims and worker._recorded == 1
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert (statuses[done.pk], statuses[waiting.pk]) == (Status.SUCCEEDED, Status.READY)


@pytest.mark.django_db(transaction=True)
def test_a_handler_changing_its_jobs_id_changes_nothing_its_worker_renews_or_records():
    # job.id = str(job.id) (for a JSON body, say): the lease keeper compared the ids it renewed
    # with job.pk, called the claim lost after two rounds and stopped renewing it.
    worker, (job,) = running(1)
    job.id = str(job.id)
    for _ in range(3):
        worker.source.leases.keep_up(worker.claims.all(), heartbeat=True)
    assert not worker.source.leases._lost
    worker.hand_in(job, Handled(Verdict.SUCCEEDED, result_json="1"))
    worker.settle_and_claim()
    assert Job.objects.values_list("status", flat=True).get() == Status.SUCCEEDED
    assert not worker.claims
