"""The data layer's part of NATS queues, without NATS: the relay's claim (sql.RELAY) and a
failed NATS attempt written back (sql.WRITE_BACK), each one guarded statement."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from django.utils import timezone

from django_pgjobs.data.jobs import IN_OUTBOX, WRITTEN
from django_pgjobs.data.records import Failure
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory

BOOM = Failure("RuntimeError", "boom")


class Refused(Exception):
    pass


def attempt_of(row: Job, attempts: int) -> Job:
    """The unsaved Job a NATS worker runs for `row`'s message, on its `attempts`th delivery
    (`row` saved, or built: its times are then now)."""
    now = timezone.now()
    run_at = row.run_at if isinstance(row.run_at, datetime) else now
    created_at = row.created_at if isinstance(row.created_at, datetime) else now
    return Job(
        id=row.pk, queue=row.queue, task=row.task, payload=row.payload, status=Status.RUNNING,
        priority=row.priority, run_at=run_at, created_at=created_at, attempts=attempts,
        max_attempts=row.max_attempts, worker="nats-worker", errors=row.errors,
        claims=row.claims + 1, started_at=timezone.now(),
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_the_relay_skips_rows_locked_elsewhere_and_takes_only_due_ones(other_connection: Any):
    locked, free = JobFactory.create_batch(2, queue="events")
    JobFactory(queue="events", run_at=timezone.now() + timezone.timedelta(hours=1), scheduled=True)
    JobFactory(queue="default")
    published: list[Job] = []
    with other_connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        taken = Job.objects.relay(["events"], limit=10, publish=published.extend)
        cursor.execute("ROLLBACK")
    assert [job.pk for job in taken] == [job.pk for job in published] == [free.pk]
    assert not Job.objects.filter(pk=free.pk).exists()
    assert Job.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_publish_that_fails_leaves_the_rows_in_the_outbox():
    rows = JobFactory.create_batch(3, queue="events")

    def refuse(jobs: list[Job]) -> None:
        raise Refused

    with pytest.raises(Refused):
        Job.objects.relay(["events"], limit=10, publish=refuse)
    assert set(Job.objects.values_list("pk", flat=True)) == {row.pk for row in rows}


@pytest.mark.django_db
def test_a_failed_attempt_with_attempts_left_writes_nothing():
    row = JobFactory.build(queue="events", max_attempts=3)
    assert Job.objects.write_back(attempt_of(row, 1), BOOM, permanent=False, delay=1.0) == "ready"
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_the_last_attempt_is_written_back_once_as_a_dead_letter():
    row = JobFactory.build(queue="events", max_attempts=3)
    assert Job.objects.write_back(attempt_of(row, 3), BOOM, permanent=False, delay=1.0) == "failed"
    dead = Job.objects.get(pk=row.pk)
    assert (dead.status, dead.attempts, dead.claims, dead.worker) == ("failed", 3, 1, "nats-worker")
    assert dead.last_error == "RuntimeError: boom" and dead.finished_at is not None
    assert [(e["attempt"], e["type"]) for e in dead.errors] == [(3, "RuntimeError")]
    # The same delivery again (its term was lost): nothing more is written.
    assert Job.objects.write_back(attempt_of(row, 3), BOOM, permanent=False, delay=1.0) == WRITTEN
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_a_permanent_error_is_written_back_at_the_first_attempt():
    row = JobFactory.build(queue="events", max_attempts=5)
    assert Job.objects.write_back(attempt_of(row, 1), BOOM, permanent=True, delay=1.0) == "failed"


@pytest.mark.django_db
def test_an_outbox_row_no_relay_holds_is_superseded_by_a_newer_delivery():
    # Left by a relay that published its message and died before its commit, or written by an
    # older delivery of the job (a handed-back retry whose acknowledgement was lost): the
    # delivery that ran after it writes its outcome in its place (test_nats_copies.py).
    row = JobFactory(queue="events", max_attempts=1)
    assert Job.objects.write_back(attempt_of(row, 1), BOOM, permanent=True, delay=0) == "failed"
    dead = Job.objects.get(pk=row.pk)
    assert (dead.status, dead.claims) == (Status.FAILED, row.claims + 1)


@pytest.mark.django_db(transaction=True)
def test_a_job_still_in_the_outbox_is_written_back_later_and_a_replayed_one_never(
    other_connection: Any,
):
    row = JobFactory(queue="events", max_attempts=1)
    attempt = attempt_of(row, 1)
    other_connection.execute("BEGIN")  # its relay's round, which has not committed yet
    other_connection.execute("SELECT FROM pgjobs_job WHERE id = %s FOR UPDATE", [row.pk])
    assert Job.objects.write_back(attempt, BOOM, permanent=True, delay=0) == IN_OUTBOX

    other_connection.execute("DELETE FROM pgjobs_job WHERE id = %s", [row.pk])
    other_connection.execute("COMMIT")  # the relay committed
    assert Job.objects.write_back(attempt, BOOM, permanent=True, delay=0) == "failed"
    assert Job.objects.filter(pk=row.pk).replay() == [row.pk]
    # A late delivery of the old message meets the replayed job: it is not the old one's.
    assert Job.objects.write_back(attempt, BOOM, permanent=True, delay=0) == WRITTEN
    assert Job.objects.get(pk=row.pk).status == Status.READY
