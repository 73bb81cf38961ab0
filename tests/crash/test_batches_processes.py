"""Batches and dependencies across real `runjobs` processes (tests/tasks.py: slow_step, part,
batch_done, mail): a diamond A → (B, C) → D runs in order across two workers, B and C side by
side; a dead A cancels the chain saying why, and its replay runs the chain; a worker SIGKILLed
right after it settled a batch's last member (its follow-up lost with its session) still
leads to one on_complete and one on_success, enqueued by another worker's sweep."""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg
import pytest

import django_pgjobs
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import connection_kwargs, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: One job at a time each, polling often: B and C, released together, run on both.
WORKER = ("--queue", "batches", "--concurrency", "1", "--poll-interval", "0.5")
#: How long a worker waits before its first sweep, and between sweeps (reap_interval).
SWEEP = 5.0


def start_two(start_worker: Any) -> list[Any]:
    started = [start_worker(*WORKER), start_worker(*WORKER)]
    assert wait_until(lambda: all(worker.started() for worker in started), 60)
    return started


def stop(workers: list[Any]) -> None:
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert [worker.wait(30) for worker in workers] == [0] * len(workers)


def diamond(fail: bool = False) -> list[Job]:
    a = tasks.slow_step.enqueue(name="a", seconds=0.2, fail=fail)
    b = tasks.slow_step.using(after=[a]).enqueue(name="b", seconds=1.5)
    c = tasks.slow_step.using(after=[a]).enqueue(name="c", seconds=1.5)
    d = tasks.slow_step.using(after=[b, c]).enqueue(name="d")
    return [a, b, c, d]


def fresh(jobs: list[Job]) -> list[Job]:
    found = Job.objects.in_bulk([job.pk for job in jobs])
    return [found[job.pk] for job in jobs]


def ran_in_order(jobs: list[Job]) -> None:
    """A before B and C, which ran side by side on the two workers, both before D."""
    a, b, c, d = fresh(jobs)
    assert [job.status for job in (a, b, c, d)] == [Status.SUCCEEDED] * 4
    assert a.finished_at <= b.started_at and a.finished_at <= c.started_at
    assert max(b.finished_at, c.finished_at) <= d.started_at
    assert b.worker != c.worker
    assert max(b.started_at, c.started_at) < min(b.finished_at, c.finished_at)  # side by side


def test_a_diamond_runs_in_order_across_two_workers(start_worker: Any) -> None:
    workers = start_two(start_worker)
    jobs = diamond()
    assert wait_until(lambda: fresh(jobs)[-1].status == Status.SUCCEEDED, 30)
    stop(workers)
    ran_in_order(jobs)


def test_a_dead_job_cancels_the_chain_saying_why_and_its_replay_runs_it(
    start_worker: Any,
) -> None:
    workers = start_two(start_worker)
    jobs = diamond(fail=True)
    a, b, c, d = jobs
    assert wait_until(lambda: fresh(jobs)[-1].status == Status.CANCELLED, 30)
    a, b, c, d = fresh(jobs)
    assert [job.status for job in (a, b, c, d)] == ["failed", "cancelled", "cancelled", "cancelled"]
    assert (
        b.last_error
        == c.last_error
        == (
            f"DependencyFailed: job {a.pk} (tests.tasks.slow_step) is a dead letter: "
            "django_pgjobs.errors.PermanentError: step a failed"
        )
    )
    assert d.last_error in {
        f"DependencyFailed: job {b.pk} (tests.tasks.slow_step) was cancelled",
        f"DependencyFailed: job {c.pk} (tests.tasks.slow_step) was cancelled",
    }
    assert b.started_at is None and c.started_at is None and d.started_at is None

    Job.objects.filter(pk=a.pk).replace_payload({"name": "a", "seconds": 0.2})
    assert Job.objects.filter(pk=a.pk).replay() == [a.pk]
    assert wait_until(lambda: fresh(jobs)[-1].status == Status.SUCCEEDED, 30)
    stop(workers)
    ran_in_order(jobs)


def test_a_worker_killed_right_after_settling_a_batchs_last_member_leaves_one_callback(
    start_worker: Any,
) -> None:
    """The batch's row is held locked, so that the worker that settles its last member (and
    commits) waits in its follow-up; the worker is SIGKILLed there and its session terminated
    (a killed client's session would go on and commit the follow-up once the lock goes). The
    other worker, which runs none of the batch's jobs, sweeps: the callbacks come once."""
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="k") as b:
        members = Job.objects.bulk_enqueue(tasks.part, [{"n": n} for n in range(3)])
    sweeper = start_worker("--queue", "elsewhere")
    with (
        psycopg.connect(**connection_kwargs(), autocommit=True) as locker,
        psycopg.connect(**connection_kwargs(), autocommit=True) as db,  # pg_stat_activity afresh
        locker.transaction(),
    ):
        locker.execute("SELECT FROM pgjobs_batch WHERE id = %s FOR UPDATE", [b.id])
        doomed = start_worker("--queue", "batches", "--concurrency", "1")

        def follow_up_waiting() -> int | None:
            row = db.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE %s AND wait_event_type = 'Lock' "
                "AND query LIKE '%%FROM pgjobs_batch AS b%%'",
                [f"pgjobs worker %:{doomed.pid}:%"],
            ).fetchone()
            return None if row is None else row[0]

        backend = wait_until(follow_up_waiting, 30)
        # Every member has ended, committed, and nothing has followed them up.
        assert set(Job.objects.filter(batch_id=b.id).values_list("status", flat=True)) == {
            Status.SUCCEEDED
        }
        assert Job.objects.filter(pk__in=[m.pk for m in members]).count() == 3
        doomed.kill()
        killed_at = time.monotonic()
        db.execute("SELECT pg_terminate_backend(%s)", [backend])
        assert wait_until(lambda: follow_up_waiting() is None, 10)
        assert not callbacks(b.id)
        # The lock is gone, and the follow-up that waited for it with it.

    assert wait_until(lambda: len(callbacks(b.id)) == 2, 2 * SWEEP + 5)
    swept_after = time.monotonic() - killed_at
    time.sleep(SWEEP + 0.5)  # one more sweep: nothing more
    assert sorted(callbacks(b.id)) == sorted([tasks.batch_done.name, tasks.mail.name])
    stored = Batch.objects.get(pk=b.id)
    assert stored.completed_at is not None and stored.succeeded_at is not None
    stop([sweeper])
    assert swept_after < 2 * SWEEP + 5


def callbacks(batch: Any) -> list[str]:
    """The tasks of the callbacks enqueued for `batch`."""
    return list(Job.objects.filter(payload__batch__id=str(batch)).values_list("task", flat=True))
