"""Two copies of one NATS job: a retry handed back to PostgreSQL (an outbox row due later) whose
message's acknowledgement was then lost, so that the message ran again. Against a real
PostgreSQL and nats-server; the lost acknowledgement is staged (the row written as the first
delivery wrote it, the message left unacknowledged)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_pgjobs import transports
from django_pgjobs.jetstream import streams
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import WorkerThread, bridge, queue, relay
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["queue"]  # a fixture


def relayed_with_claims(job: Job, claims: int) -> dict[str, Any]:
    """Relay `job` as a message counting `claims`; returns its row as it was."""
    Job.objects.filter(pk=job.pk).update(claims=claims)
    row = Job.objects.filter(pk=job.pk).values().get()
    assert relay().round() == 1
    return row


def handed_back_by_an_older_delivery(row: dict[str, Any], claims: int) -> None:
    """The outbox row an older delivery of the job wrote as it handed its retry back (due in
    ten minutes), whose message's acknowledgement was then lost."""
    Job.objects.create(**{
        **row, "status": Status.READY, "claims": claims, "attempts": 1,
        "run_at": timezone.now() + timedelta(minutes=10),
    })  # fmt: skip


def test_a_newer_deliverys_failure_supersedes_an_older_deliverys_outbox_row(queue: str) -> None:
    # Before: the older row stood in the way (IN_OUTBOX): the newer delivery was delivered
    # again every second, its 0.4 s backoff and its errors lost, until it was dead-lettered
    # as "WorkerLost: delivered 4 times without an outcome" (attack 15).
    job = tasks.fails_after_a_pause.using(queue=queue).enqueue()
    row = relayed_with_claims(job, claims=1)  # a message from a handed-back row: claims 1
    handed_back_by_an_older_delivery(row, claims=1)  # ...and its older copy's row
    with WorkerThread(queue):
        dead = wait_until(
            lambda: Job.objects.filter(pk=job.pk, status=Status.FAILED).first(), timeout=30
        )
    # Its own error, on its last attempt (a NATS job's negatively acknowledged attempts keep
    # no history); not "WorkerLost", past its attempts.
    assert [(entry["type"], entry["attempt"]) for entry in dead.errors] == [("RuntimeError", 3)]
    assert dead.attempts == 3


def test_a_redelivered_message_that_succeeds_drops_its_handed_back_copy(queue: str) -> None:
    # Before: the copy ran again at its retry, ten minutes later, though the job had succeeded.
    job = tasks.ledger.using(queue=queue).enqueue(n=1)
    row = relayed_with_claims(job, claims=0)
    handed_back_by_an_older_delivery(row, claims=1)  # the first delivery's hand-back
    nats_queue = transports.nats_queues()[queue]
    first = bridge()  # the first delivery, whose acknowledgement is lost
    subscription, _ = streams.ensure_consumer(first, nats_queue, ack_wait=1.0, max_ack_pending=10)
    assert len(first.fetch(subscription, 1, 5.0)) == 1
    time.sleep(1.5)  # its ack wait over: delivered again
    with WorkerThread(queue, lease=1.0):
        wait_until(lambda: ChaosExecution.objects.count() == 1, timeout=30)
        wait_until(lambda: not Job.objects.filter(pk=job.pk).exists(), timeout=10)
