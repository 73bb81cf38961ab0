"""A message the server refuses as over its max_payload, against a real nats-server: nats-py
closes its connection for good on that error, and the relay and the worker carry on."""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

import pytest

from django_pgjobs.jetstream import messages
from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import WorkerThread, queue, relay, stream_messages
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["queue"]  # a fixture


def close_as_nats_py_does(bridge: Bridge) -> None:
    """Make the server send an error on `bridge`'s connection: a message within max_payload
    by its body, over it with its headers. nats-py closes the connection for good."""
    client = bridge.client
    body = b"x" * (client.max_payload - 8)
    with contextlib.suppress(Exception):
        bridge.publish([(f"pgjobstest.poison.{uuid.uuid4().hex}", body, {"Nats-Msg-Id": "x"})])
    wait_until(lambda: client.is_closed, timeout=10)


def test_a_message_over_max_payload_with_its_headers_is_a_dead_letter_and_the_others_relay_on(
    queue: str, settings: Any
) -> None:
    # Before: only its body was compared with max_payload; the server refused the message,
    # nats-py closed the connection, and the relay failed every round until a restart.
    settings.PGJOBS = {**settings.PGJOBS, "MAX_PAYLOAD_BYTES": 4_000_000}
    relaying = relay()
    limit = relaying.bridge.client.max_payload
    big = Job.objects.enqueue(tasks.takes_anything, {"order_id": 0, "blob": ""}, queue=queue)
    unfilled = len(messages.body(Job.objects.get(pk=big.pk)))
    blob = "x" * (limit - 10 - unfilled)
    Job.objects.filter(pk=big.pk).update(payload={"order_id": 0, "blob": blob})
    assert len(messages.body(Job.objects.get(pk=big.pk))) == limit - 10
    other = tasks.ledger.using(queue=queue).enqueue(n=1)

    assert relaying.round() == 2
    dead = Job.objects.get(pk=big.pk)
    assert dead.status == Status.FAILED and "over the NATS server's max_payload" in dead.last_error
    assert not Job.objects.filter(pk=other.pk).exists()
    assert stream_messages(queue) == 1
    tasks.ledger.using(queue=queue).enqueue(n=2)
    assert relaying.round() == 1


def test_a_relay_whose_connection_nats_py_closed_connects_again(
    queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    relaying = relay()
    tasks.ledger.using(queue=queue).enqueue(n=1)
    assert relaying.round() == 1
    close_as_nats_py_does(relaying.bridge)
    tasks.ledger.using(queue=queue).enqueue(n=2)
    with caplog.at_level(logging.WARNING, "django_pgjobs"):
        assert relaying.round() == 1
    assert stream_messages(queue) == 2
    assert any("connection was closed" in r.getMessage() for r in caplog.records)


def test_a_worker_whose_connection_nats_py_closed_connects_again_and_runs_jobs(
    queue: str,
) -> None:
    # Before: its fetches saw a connection not connected and waited, silently, for ever.
    tasks.ledger.using(queue=queue).enqueue(n=1)
    relay().round()
    with WorkerThread(queue) as worker:
        wait_until(lambda: ChaosExecution.objects.count() == 1, timeout=30)
        close_as_nats_py_does(worker.source.bridge)
        tasks.ledger.using(queue=queue).enqueue(n=2)
        relay().round()
        wait_until(lambda: ChaosExecution.objects.count() == 2, timeout=30)
