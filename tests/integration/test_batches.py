"""Batches and dependencies against the real database: a batch's callbacks are enqueued once,
when its last job ends, and a job enqueued with after= waits for its dependencies to succeed
(batches.py, data/sql.py FINISH_BATCHES and RELEASE_WAITERS)."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now

import django_pgjobs
from django_pgjobs import batches
from django_pgjobs.data.records import FailedAttempt, Failure
from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Batch, Dependency, Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def callbacks(task: Any = tasks.batch_done) -> list[dict[str, Any]]:
    return [job.payload for job in Job.objects.filter(task=task.name).order_by("created_at")]


def status(job: Job) -> str:
    job.refresh_from_db()
    return job.status


def test_a_batchs_jobs_join_it_and_its_callbacks_come_once_when_the_last_one_ends() -> None:
    with django_pgjobs.batch(
        on_complete=tasks.batch_done, on_success="tests.tasks.batch_done", export_id=7
    ) as b:
        one = tasks.part.enqueue(n=1)
        more = Job.objects.bulk_enqueue(tasks.part, [{"n": 2}, {"n": 3}])
    assert {job.batch_id for job in (one, *more)} == {b.id}
    assert Job.objects.filter(batch_id=b.id).count() == 3
    assert Batch.objects.get(pk=b.id).size == 3
    assert callbacks() == []

    run_jobs(queues=["batches"], tasks=[tasks.part])
    counts = {"id": str(b.id), "succeeded": 3, "failed": 0, "cancelled": 0}
    assert callbacks() == [{"export_id": 7, "batch": counts}] * 2
    stored = Batch.objects.get(pk=b.id)
    assert stored.completed_at is not None and stored.succeeded_at is not None
    assert (stored.succeeded, stored.failed, stored.cancelled) == (3, 0, 0)

    batches.follow_up("default", batches=[b.id])  # again, as a sweep would: nothing more
    assert len(callbacks()) == 2


def test_a_dead_member_completes_the_batch_and_its_replay_then_success_succeeds_it() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="x") as b:
        tasks.part.enqueue(n=1)
        failing = tasks.part.enqueue(n=2, fail=True)
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert status(failing) == Status.FAILED
    assert callbacks() == [
        {"name": "x", "batch": {"id": str(b.id), "succeeded": 1, "failed": 1, "cancelled": 0}}
    ]
    assert callbacks(tasks.mail) == []

    Job.objects.filter(pk=failing.pk).replace_payload({"n": 2})
    Job.objects.filter(pk=failing.pk).replay()
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert len(callbacks()) == 1  # on_complete was enqueued once, and stays so
    assert callbacks(tasks.mail) == [
        {"name": "x", "batch": {"id": str(b.id), "succeeded": 2, "failed": 0, "cancelled": 0}}
    ]


def test_an_empty_batch_calls_back_at_once_and_a_failed_block_writes_nothing() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done) as empty:
        pass
    assert callbacks() == [
        {"batch": {"id": str(empty.id), "succeeded": 0, "failed": 0, "cancelled": 0}}
    ]
    with pytest.raises(ZeroDivisionError), django_pgjobs.batch(on_complete=tasks.batch_done) as b:
        tasks.part.enqueue(n=1)
        1 / 0  # noqa: B018
    assert not Batch.objects.filter(pk=b.id).exists()
    assert not Job.objects.filter(task=tasks.part.name).exists()


def test_a_batch_is_written_in_the_callers_transaction() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        with django_pgjobs.batch(on_complete=tasks.batch_done) as b:
            tasks.part.enqueue(n=1)
        assert Batch.objects.filter(pk=b.id).exists()
        raise RuntimeError("the view failed")
    assert not Batch.objects.exists() and not Job.objects.exists()


def test_a_cancelled_member_counts_and_the_batch_completes() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done) as b:
        tasks.part.enqueue(n=1)
        cancelled = tasks.part.enqueue(n=2)
    assert Job.objects.filter(pk=cancelled.pk).cancel() == [cancelled.pk]
    assert callbacks() == []
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert callbacks() == [
        {"batch": {"id": str(b.id), "succeeded": 1, "failed": 0, "cancelled": 1}}
    ]


def test_the_batch_refuses_what_it_cannot_do() -> None:
    with pytest.raises(EnqueueError, match=re.escape("batch(batch=...)")):
        django_pgjobs.batch(on_complete=tasks.batch_done, batch=1).__enter__()
    refused = [
        (tasks.send_email, "batch(on_success=...): the payload does not fit"),  # needs `to`
        ("no_such.task", "no_such.task"),
    ]
    for callback, says in refused:
        with pytest.raises(EnqueueError, match=re.escape(says)):
            django_pgjobs.batch(on_success=callback).__enter__()
    assert not Batch.objects.exists()


def test_two_sessions_ending_the_last_two_jobs_at_once_enqueue_one_callback() -> None:
    """Each ends one of the last two jobs in its own transaction, committed together: each
    transaction sees the other's job still running, and the follow-up after the commits sees
    both (repeated, under stress, in tests/property/test_batches.py)."""
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="y"):
        first, second = tasks.part.enqueue(n=1), tasks.part.enqueue(n=2)
    claimed = Job.objects.claim(["batches"], worker="w", limit=2)
    assert len(claimed) == 2
    barrier = threading.Barrier(2)

    def settle(job: Job) -> None:
        try:
            barrier.wait()
            Job.objects.complete(job)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=settle, args=(job,)) for job in claimed]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {status(first), status(second)} == {Status.SUCCEEDED}
    assert len(callbacks()) == 1 and len(callbacks(tasks.mail)) == 1


def test_a_lost_follow_up_is_done_by_a_sweep() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done) as b:
        job = tasks.part.enqueue(n=1)
    with connection.cursor() as cursor:  # ended without a follow-up: its session was killed
        cursor.execute(
            "UPDATE pgjobs_job SET status = 'succeeded', finished_at = now() WHERE id = %s",
            [job.pk],
        )
    assert callbacks() == []
    batches.Sweep()("default")
    assert [payload["batch"]["id"] for payload in callbacks()] == [str(b.id)]


def test_a_worker_follows_up_what_its_turn_ended() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done):
        tasks.part.enqueue(n=1)
        tasks.part.enqueue(n=2)
    first, second = Job.objects.claim(["batches"], worker="w", limit=2)
    dead = FailedAttempt(second, Failure("ValueError", "no"), permanent=True, delay=0)
    settled = Job.objects.settle_and_claim([first], [dead], ["batches"], worker="w", limit=1)
    assert settled.succeeded == {first.pk} and settled.failed == {second.pk: Status.FAILED}
    ((payload),) = callbacks()
    assert payload["batch"]["succeeded"] == 1 and payload["batch"]["failed"] == 1


# ---- after= -------------------------------------------------------------------------------------


def order_of(jobs: list[Job]) -> list[str]:
    finished = Job.objects.filter(pk__in=[job.pk for job in jobs], status=Status.SUCCEEDED)
    return [job.payload["name"] for job in finished.order_by("finished_at", "started_at")]


def test_a_diamond_runs_in_order() -> None:
    a = tasks.step.enqueue(name="a")
    b = tasks.step.using(after=[a]).enqueue(name="b")
    c = tasks.step.using(after=a).enqueue(name="c")
    d = tasks.step.using(after=[b, c.pk]).enqueue(name="d")
    assert [status(job) for job in (a, b, c, d)] == ["ready", "waiting", "waiting", "waiting"]
    assert sorted(Dependency.objects.filter(job=d).values_list("after_job", flat=True)) == sorted(
        [b.pk, c.pk]
    )
    run_jobs(queues=["batches"])
    order = order_of([a, b, c, d])
    assert order[0] == "a" and order[-1] == "d" and sorted(order[1:3]) == ["b", "c"]


def test_a_dead_job_cancels_the_chain_saying_why_and_its_replay_runs_it() -> None:
    a = tasks.step.enqueue(name="a", fail=True)
    b = tasks.step.using(after=[a]).enqueue(name="b")
    c = tasks.step.using(after=[a]).enqueue(name="c")
    d = tasks.step.using(after=[b, c]).enqueue(name="d")
    run_jobs(queues=["batches"])
    assert [status(job) for job in (a, b, c, d)] == [
        "failed",
        "cancelled",
        "cancelled",
        "cancelled",
    ]
    b.refresh_from_db()
    d.refresh_from_db()
    assert b.last_error == (
        f"DependencyFailed: job {a.pk} (tests.tasks.step) is a dead letter: "
        "django_pgjobs.errors.PermanentError: step a failed"
    )
    assert d.last_error.startswith(f"DependencyFailed: job {b.pk} (tests.tasks.step) was cancelled")

    Job.objects.filter(pk=a.pk).replace_payload({"name": "a"})
    Job.objects.filter(pk=a.pk).replay()
    assert status(b) == "cancelled"  # released when a succeeds, not before
    run_jobs(queues=["batches"])
    assert [status(job) for job in (a, b, c, d)] == ["succeeded"] * 4
    assert order_of([a, b, c, d])[-1] == "d"


def test_a_job_after_a_batch_waits_for_all_of_it_and_dependencies_done_already_count() -> None:
    with django_pgjobs.batch() as b:
        tasks.part.enqueue(n=1)
        tasks.part.enqueue(n=2)
    after = tasks.step.using(after=b).enqueue(name="after the batch")
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert status(after) == Status.READY
    done = tasks.step.enqueue(name="done")
    run_jobs(queues=["batches"])
    late = tasks.step.using(after=[done]).enqueue(name="late")
    assert status(late) == Status.READY  # judged once its enqueue committed


def test_a_job_after_a_failed_batch_is_cancelled() -> None:
    with django_pgjobs.batch() as b:
        tasks.part.enqueue(n=1, fail=True)
    after = tasks.step.using(after=b).enqueue(name="after")
    run_jobs(queues=["batches"], tasks=[tasks.part])
    after.refresh_from_db()
    assert after.status == Status.CANCELLED
    assert after.last_error == (
        f"DependencyFailed: batch {b.id} completed with 1 dead and 0 cancelled of 1 jobs"
    )


def test_an_operator_cancel_of_a_waiting_job_is_never_undone() -> None:
    a = tasks.step.enqueue(name="a")
    b = tasks.step.using(after=[a]).enqueue(name="b")
    assert Job.objects.filter(pk=b.pk).cancel() == [b.pk]
    run_jobs(queues=["batches"])
    assert (status(a), status(b)) == ("succeeded", "cancelled")


def test_after_refuses_what_it_cannot_wait_for() -> None:
    a = tasks.step.enqueue(name="a")
    with pytest.raises(EnqueueError, match="after= with unique_key="):
        tasks.step.using(after=[a], unique_key="k").enqueue(name="b")
    with pytest.raises(EnqueueError, match=r"after=\[\]"):
        tasks.step.using(after=[]).enqueue(name="b")
    with pytest.raises(EnqueueError, match="is not a job, a batch"):
        tasks.step.using(after=["nonsense"]).enqueue(name="b")
    missing = "0190d7a4-0000-7000-8000-000000000000"
    with pytest.raises(EnqueueError, match=f"no job or batch {missing}"):
        tasks.step.using(after=[a, missing]).enqueue(name="b")
    with pytest.raises(EnqueueError, match="after its block"), django_pgjobs.batch() as b:
        tasks.step.using(after=b).enqueue(name="b")
    assert list(Job.objects.values_list("payload__name", flat=True)) == ["a"]


def test_pruning_keeps_what_a_waiting_job_or_an_open_batch_still_reads() -> None:
    from datetime import timedelta

    a = tasks.step.enqueue(name="a")
    b = tasks.step.enqueue(name="b")
    waiting = tasks.step.using(after=[a, b]).enqueue(name="c")
    with django_pgjobs.batch() as open_batch:
        member = tasks.part.enqueue(n=1)
        tasks.part.enqueue(n=2)
    plain = tasks.step.enqueue(name="plain")
    done = [a, member, plain]
    Job.objects.filter(pk__in=[job.pk for job in done]).update(
        status=Status.SUCCEEDED, finished_at=Now() - timedelta(seconds=1)
    )
    right_away = {"succeeded": timedelta(0)}
    assert list(Job.objects.prunable(right_away)) == [plain]
    assert Job.objects.prune(retention=right_away) == 1
    run_jobs(queues=["batches"])  # b, then c (a still there: it succeeded), the other part
    assert status(waiting) == Status.SUCCEEDED
    assert Batch.objects.get(pk=open_batch.id).succeeded == 2


def test_a_batch_whose_dead_job_was_deleted_never_succeeds() -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="z") as b:
        tasks.part.enqueue(n=1)
        dead = tasks.part.enqueue(n=2, fail=True)
    after = tasks.step.using(after=b).enqueue(name="after")
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert status(after) == Status.CANCELLED
    assert Job.objects.filter(pk=dead.pk).discard() == [dead.pk]
    batches.Sweep()("default")
    assert callbacks(tasks.mail) == [] and status(after) == Status.CANCELLED
    assert Batch.objects.get(pk=b.id).succeeded_at is None


def test_an_operators_cancel_after_a_replay_is_never_undone() -> None:
    a = tasks.step.enqueue(name="a", fail=True)
    w = tasks.step.using(after=[a]).enqueue(name="w")
    run_jobs(queues=["batches"])
    assert status(w) == Status.CANCELLED  # by its dependency
    Job.objects.filter(pk=w.pk).replay()
    assert status(w) == Status.CANCELLED  # judged again: a is still dead
    Job.objects.filter(pk=a.pk).replace_payload({"name": "a"})
    Job.objects.filter(pk=a.pk).replay()
    Job.objects.filter(pk=w.pk).replay()
    assert status(w) == Status.WAITING
    assert Job.objects.filter(pk=w.pk).cancel() == [w.pk]  # the operator's
    run_jobs(queues=["batches"])
    assert (status(a), status(w)) == (Status.SUCCEEDED, Status.CANCELLED)


def test_a_batchs_id_may_be_waited_for_and_a_delay_is_kept() -> None:
    from datetime import timedelta

    with django_pgjobs.batch() as b:
        tasks.part.enqueue(n=1)
    later = tasks.step.using(after=[b.id], delay=timedelta(hours=1)).enqueue(name="later")
    assert list(Dependency.objects.filter(job=later).values_list("after_batch", flat=True)) == [
        b.id
    ]
    run_jobs(queues=["batches"])
    later.refresh_from_db()
    assert later.status == Status.READY and later.scheduled
    assert later.run_at > later.created_at + timedelta(minutes=59)
