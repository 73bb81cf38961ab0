"""A relay round whose messages the stream does not all acknowledge, against a real nats-server:
what was acknowledged leaves the outbox, the rest stays, and a failing queue does not hold back
the others."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from django_pgjobs import transports
from django_pgjobs.models import Job
from tests import tasks
from tests.integration.nats_helpers import (
    NATS_URL,
    bridge,
    make_stream,
    nats,
    queue_settings,
    relay,
    stream_messages,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_queues(settings: Any) -> Iterator[tuple[str, str]]:
    """Two queues carried by NATS, each with its stream; deleted afterwards."""
    names = tuple(f"pgjobstest_{uuid.uuid4().hex[:12]}" for _ in range(2))
    settings.PGJOBS = {
        **settings.PGJOBS,
        "QUEUES": {name: next(iter(queue_settings(name).values())) for name in names},
        "NATS": {"SERVERS": NATS_URL},
    }
    try:
        yield names[0], names[1]
    finally:
        cleaner = bridge()
        for name in names:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                cleaner.call(cleaner.js.delete_stream(transports.nats_queues()[name].stream))
            with contextlib.suppress(nats.js.errors.NotFoundError):
                cleaner.call(cleaner.js.delete_stream(f"FOREIGN_{name}"))
        cleaner.close()


def test_a_queue_whose_messages_are_not_acknowledged_holds_back_no_other_and_no_job_twice(
    two_queues: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the round was all or nothing, though the stream kept what it acknowledged; the
    # good queue's jobs stayed in the outbox, published again every round (and run again
    # once per duplicate window), for as long as the other queue's messages failed.
    good, failing = two_queues
    make_stream(good)
    make_stream(failing)
    relaying = relay()
    assert relaying.round() == 0
    admin = bridge()
    admin.call(admin.js.delete_stream(transports.nats_queues()[failing].stream))  # no responders

    sent = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=good)
    stuck = tasks.ledger.using(queue=failing).enqueue(n=9)
    with caplog.at_level(logging.WARNING, "django_pgjobs"):
        assert relaying.round() == 3
    assert not Job.objects.filter(pk__in=[job.pk for job in sent]).exists()
    assert Job.objects.filter(queue=failing).get().pk == stuck.pk  # stays in the outbox
    assert stream_messages(good) == 3
    said = [r.getMessage() for r in caplog.records if "not acknowledged" in r.getMessage()]
    assert len(said) == 1 and repr(failing) in said[0] and str(stuck.pk) in said[0]

    # Its backoff over, the failing queue is tried again, its stream made again: relayed.
    time.sleep(0.3)
    assert relaying.round() == 1
    assert not Job.objects.filter(queue=failing).exists()
    assert stream_messages(failing) == 1 and stream_messages(good) == 3


def test_a_queue_whose_stream_cannot_be_made_holds_back_no_other(
    two_queues: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the first queue whose stream could not be made (here its subject is another
    # stream's) stopped every round before any queue was relayed.
    good, failing = two_queues
    admin = bridge()
    subject = transports.nats_queues()[failing].subject
    admin.call(admin.js.add_stream(name=f"FOREIGN_{failing}", subjects=[subject]))

    tasks.ledger.using(queue=good).enqueue(n=1)
    tasks.ledger.using(queue=failing).enqueue(n=2)
    with caplog.at_level(logging.WARNING, "django_pgjobs"):
        assert relay().round() == 1
    assert not Job.objects.filter(queue=good).exists()
    assert Job.objects.filter(queue=failing).count() == 1
    said = [r.getMessage() for r in caplog.records if "could not make its stream" in r.getMessage()]
    assert len(said) == 1 and repr(failing) in said[0]


def test_a_round_publishes_at_most_its_bytes_and_the_next_takes_the_rest(
    two_queues: tuple[str, str], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_pgjobs.jetstream import relay as relay_module

    good, _ = two_queues
    monkeypatch.setattr(relay_module, "ROUND_BYTES", 5_000)
    make_stream(good)
    Job.objects.bulk_enqueue(
        tasks.takes_anything, [{"order_id": n, "blob": "x" * 2_000} for n in range(5)], queue=good
    )
    relaying = relay()
    assert relaying.round() == 2 and relaying.cut_short
    assert relaying.round() == 2 and relaying.cut_short
    assert relaying.round() == 1 and not relaying.cut_short
    assert stream_messages(good) == 5
