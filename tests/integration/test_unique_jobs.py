"""unique_key under concurrency: one live job per key, whoever enqueues it at the same moment."""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import run_together, wait_until
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


@pytest.mark.django_db(transaction=True)  # threads, each on its own connection
@pytest.mark.parametrize("round", range(5))
def test_eight_threads_enqueueing_one_key_at_once_create_one_job_and_all_get_it(round):
    returned = run_together(
        8, lambda n: Job.objects.enqueue("tests.tasks.noop", unique_key=f"nightly-{round}")
    )
    [job] = Job.objects.filter(unique_key=f"nightly-{round}")
    assert [getattr(each, "pk", each) for each in returned] == [job.pk] * 8


def test_a_finished_job_frees_its_key():
    first = JobFactory(succeeded=True, unique_key="k")
    second = Job.objects.enqueue("tests.tasks.noop", unique_key="k")
    assert second.pk != first.pk and second.status == Status.READY


def waiting_on_a_lock() -> bool:
    """Some session is blocked on a lock (here: the unique index's entry of an open insert)."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%%INSERT INTO pgjobs_job%%'"
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)  # threads, each on its own connection
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_an_enqueue_waits_for_an_uncommitted_job_with_its_key(outcome):
    inserted, finish = threading.Event(), threading.Event()
    holder: list[Job] = []
    waiter: list[Job] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                holder.append(Job.objects.enqueue("tests.tasks.noop", unique_key="k"))
                inserted.set()
                finish.wait(10)
                if outcome == "rollback":
                    transaction.set_rollback(True)
        finally:
            connections.close_all()

    def enqueue() -> None:
        try:
            waiter.append(Job.objects.enqueue("tests.tasks.noop", unique_key="k"))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=hold), threading.Thread(target=enqueue)]
    threads[0].start()
    assert inserted.wait(10)
    threads[1].start()
    wait_until(waiting_on_a_lock, timeout=10)
    assert not waiter  # blocked until the other transaction ends
    finish.set()
    for thread in threads:
        thread.join(10)
    [job] = Job.objects.filter(unique_key="k")
    assert waiter == [job]
    if outcome == "commit":
        assert job.pk == holder[0].pk  # it got the committed job back
    else:
        assert job.pk != holder[0].pk  # the other rolled back: it inserted its own
