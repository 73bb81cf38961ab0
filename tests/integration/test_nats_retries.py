"""A NATS job whose retry waits longer than its message should wait in the stream, against a real
nats-server: it is handed back to PostgreSQL, an outbox row due when its retry is."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_pgjobs.models import Job, Queue
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import (
    WorkerThread,
    bridge,
    consumer_info,
    nats_queue,
    queue,
    relay,
)
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["queue"]  # a fixture


def handed_back(job: Job) -> Job | None:
    return Job.objects.filter(pk=job.pk, status=Status.READY).first()


def test_jobs_waiting_out_a_long_backoff_take_no_running_slot(queue: str) -> None:
    # Before: each waited out its backoff as a message negatively acknowledged with a delay,
    # holding one of the consumer's max ack pending (the queue's max_running) all along: two
    # of them stopped a max_running=2 queue for their ten minutes.
    Queue.objects.create(name=queue, max_running=2)
    failing = [tasks.fails_and_waits.using(queue=queue).enqueue() for _ in range(2)]
    relay().round()
    reader = bridge()
    with WorkerThread(queue, lease=5.0):
        backing_off = [wait_until(lambda j=job: handed_back(j), timeout=30) for job in failing]
        others = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
        relay().round()
        wait_until(lambda: ChaosExecution.objects.count() == 3, timeout=15)
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=10)
    assert sorted(ChaosExecution.objects.values_list("job_id", flat=True)) == sorted(
        job.pk for job in others
    )
    for row in backing_off:  # its attempt and error recorded, due after the backoff
        assert row.attempts == 1 and [entry["attempt"] for entry in row.errors] == [1]
        assert row.last_error.startswith("RuntimeError")
        assert row.run_at > timezone.now() + timedelta(seconds=590)
        assert row.claims == 1  # relayed under a message id of its own


@pytest.fixture
def short_lived_queue(settings: Any) -> Iterator[str]:
    with nats_queue(settings, MAX_AGE=10, DUPLICATE_WINDOW=5) as name:
        yield name


def test_a_retry_later_than_the_streams_max_age_is_kept_in_postgresql(
    short_lived_queue: str,
) -> None:
    # Before: the message was negatively acknowledged with the delay and expired in the
    # stream meanwhile: the job was gone, with no row, no dead letter and no log line.
    queue = short_lived_queue
    job = tasks.asks_to_retry.using(queue=queue).enqueue(seconds=20)
    relay().round()
    reader = bridge()
    with WorkerThread(queue, lease=2.0):
        row = wait_until(lambda: handed_back(job), timeout=30)
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=10)
    assert row.attempts == 1 and row.claims == 1 and not row.errors
    assert row.run_at > timezone.now() + timedelta(seconds=10)
    assert relay().round() == 0  # not due yet: it waits in the outbox

    # Due, it is relayed under a message id of its own, and its next delivery is attempt 2.
    Job.objects.filter(pk=job.pk).run_now()
    assert relay().round() == 1
    with WorkerThread(queue, lease=2.0):
        again = wait_until(lambda: handed_back(job), timeout=30)
    assert again.attempts == 2 and again.claims == 2
