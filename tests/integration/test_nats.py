"""Queues carried by NATS JetStream, against a real nats-server: the outbox and its relay, the
worker, retries, dead letters written back and replayed, shared work and fan-out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from django_pgjobs import transports
from django_pgjobs.models import DeadLetter, Job, Queue
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import (
    WorkerThread,
    bridge,
    nats,
    nats_queue,
    relay,
    stream_messages,
)
from tests.integration.test_admin import DEAD, act, messages_of
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def queue(settings: Any) -> Iterator[str]:
    with nats_queue(settings) as name:
        yield name


class Boom(Exception):
    pass


def test_a_job_whose_enqueue_rolls_back_is_never_published(queue: str) -> None:
    with pytest.raises(Boom), transaction.atomic():
        tasks.ledger.using(queue=queue).enqueue(n=1)
        raise Boom
    committed = tasks.ledger.using(queue=queue).enqueue(n=2)

    assert relay().round() == 1
    assert stream_messages(queue) == 1
    assert not Job.objects.filter(pk=committed.pk).exists()  # the outbox row went with it


def test_a_relay_that_fails_before_its_commit_publishes_nothing_twice(queue: str) -> None:
    jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(50)], queue=queue)
    crashing = relay()
    publish = crashing._publish

    def publish_then_die(batch: list[Job]) -> None:
        publish(batch)  # the stream has them...
        raise Boom  # ...but the rows' deletion never commits

    crashing._publish = publish_then_die  # type: ignore[method-assign]
    with pytest.raises(Boom):
        crashing.round()
    assert Job.objects.filter(queue=queue, status=Status.READY).count() == 50

    assert relay().round() == 50
    assert stream_messages(queue) == 50  # the second publish of each id was dropped
    assert not Job.objects.filter(pk__in=[job.pk for job in jobs]).exists()


def test_a_job_whose_message_the_server_refuses_as_too_large_is_a_dead_letter_alone(
    queue: str, settings: Any
) -> None:
    # Retried, it failed every relay round and held back every NATS queue's outbox, and the
    # jobs published with it were published again each round (run again once the duplicate
    # window had passed).
    settings.PGJOBS = {**settings.PGJOBS, "MAX_PAYLOAD_BYTES": 4_000_000}
    big = Job.objects.enqueue(
        tasks.takes_anything, {"order_id": 0, "blob": "x" * 1_100_000}, queue=queue
    )
    others = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in (1, 2, 3)], queue=queue)
    assert relay().round() == 4
    assert stream_messages(queue) == 3
    dead = Job.objects.get(pk=big.pk)
    assert dead.status == Status.FAILED
    assert "over the NATS server's max_payload of 1,048,576" in dead.last_error
    assert not Job.objects.filter(pk__in=[job.pk for job in others]).exists()  # published


def test_a_message_carries_its_text_as_utf_8_not_escaped() -> None:
    from django_pgjobs.jetstream import messages

    job = Job(queue="q", task="t", payload={"note": "中" * 300_000}, attempts=0, max_attempts=1,
              claims=0, errors=[], run_at=timezone.now(), created_at=timezone.now())  # fmt: skip
    assert len(messages.body(job)) < 1_000_000  # escaped: 1.8 MB, over NATS's 1 MiB default


def test_a_delayed_job_waits_in_the_outbox_until_it_is_due(queue: str) -> None:
    later = tasks.ledger.using(queue=queue, delay=3600).enqueue(n=1)
    tasks.ledger.using(queue=queue).enqueue(n=2)

    assert relay().round() == 1
    assert Job.objects.get(pk=later.pk).status == Status.READY

    Job.objects.filter(pk=later.pk).run_now()
    assert relay().round() == 1
    assert stream_messages(queue) == 2


def test_each_committed_job_runs_once(queue: str) -> None:
    jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(40)], queue=queue)
    relay().round()

    with WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.count() >= 40, timeout=30)

    runs = list(ChaosExecution.objects.values_list("job_id", flat=True))
    assert sorted(runs) == sorted(job.pk for job in jobs)
    assert not DeadLetter.objects.filter(queue=queue).exists()


def test_a_failing_job_is_retried_then_dead_lettered_in_postgresql_and_replayed(
    queue: str, admin_client: Any
) -> None:
    tasks.calls.clear()
    job = tasks.fails_and_counts.using(queue=queue).enqueue()  # max_attempts=3
    relay().round()

    with WorkerThread(queue):
        dead = wait_until(lambda: DeadLetter.objects.filter(pk=job.pk, status="failed").first(),
                          timeout=30)  # fmt: skip
        assert tasks.calls["fails_and_counts"] == 3
        assert dead.attempts == 3
        assert dead.task == job.task and dead.payload == {} and dead.queue == queue
        assert dead.last_error.startswith("RuntimeError")
        assert [entry["attempt"] for entry in dead.errors] == [3]
        assert dead.finished_at is not None

        # Replay from the admin: ready again in the outbox, relayed under a new message id, run
        # again through NATS.
        response = act(admin_client, DEAD, "replay", [dead])
        (said,) = messages_of(response)
        assert said.startswith("1 job replayed. 1 went to NATS JetStream (")
        assert relay().round() == 1
        wait_until(lambda: tasks.calls["fails_and_counts"] == 6, timeout=30)
        again = wait_until(
            lambda: DeadLetter.objects.filter(pk=job.pk, status="failed").first(), timeout=30
        )
    assert again.claims == dead.claims + 1
    assert [entry.get("replayed_at") is not None for entry in again.errors][-2:] == [True, False]


def test_a_retry_waits_for_the_tasks_backoff(queue: str) -> None:
    tasks.failed_at.clear()
    job = tasks.fails_after_a_pause.using(queue=queue).enqueue()
    relay().round()
    with WorkerThread(queue):
        wait_until(lambda: DeadLetter.objects.filter(pk=job.pk).exists(), timeout=30)
    first, second, third = tasks.failed_at
    assert second - first >= 0.38 and third - second >= 0.38  # the nak's delay: the backoff


def test_a_permanent_error_is_dead_lettered_at_the_first_attempt(queue: str) -> None:
    job = tasks.fails_permanently.using(queue=queue).enqueue()
    relay().round()
    with WorkerThread(queue):
        dead = wait_until(lambda: DeadLetter.objects.filter(pk=job.pk).first(), timeout=30)
    assert dead.attempts == 1 and dead.status == Status.FAILED


def test_two_workers_share_a_queue_and_a_second_consumer_sees_every_job(queue: str) -> None:
    jobs = Job.objects.bulk_enqueue(
        tasks.ledger, [{"n": n, "seconds": 0.01} for n in range(200)], queue=queue
    )
    relay().round()

    with WorkerThread(queue, concurrency=2) as one, WorkerThread(queue, concurrency=2) as two:
        wait_until(lambda: ChaosExecution.objects.count() >= 200, timeout=60)

    by_worker = dict(
        ChaosExecution.objects.values_list("worker").annotate(models_count()).order_by()
    )
    assert set(by_worker) == {one.id, two.id}
    assert sum(by_worker.values()) == 200
    assert ChaosExecution.objects.values("job_id").distinct().count() == 200

    # Fan-out: another service's consumer of the same stream reads every job.
    analytics = bridge()
    stream = transports.nats_queues()[queue]
    sub = analytics.call(
        analytics.js.pull_subscribe(stream.subject, durable="analytics", stream=stream.stream)
    )
    seen: set[str] = set()
    while len(seen) < 200:
        batch = analytics.fetch(sub, 100, 2.0)
        assert batch, f"the analytics consumer saw {len(seen)} of 200 jobs"
        seen |= {msg.headers["Nats-Msg-Id"].split(":")[0] for msg in batch}
        analytics.settle(batch, [], [])
    assert seen == {str(job.pk) for job in jobs}


def models_count() -> Any:
    from django.db.models import Count

    return Count("id")


def test_a_paused_queue_is_not_fetched_and_max_running_bounds_the_consumer(queue: str) -> None:
    Queue.objects.create(name=queue, paused=True, max_running=2)
    jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(6)], queue=queue)
    relay().round()

    with WorkerThread(queue):
        nats_queue_ = transports.nats_queues()[queue]
        reader = bridge()
        consumer = wait_until(lambda: _consumer(reader, nats_queue_), timeout=30)
        assert consumer.config.max_ack_pending == 2  # the queue's max_running
        time.sleep(1.5)  # a few turns of the worker: it must not fetch a paused queue
        assert not ChaosExecution.objects.exists()
        Queue.objects.filter(name=queue).resume()
        wait_until(lambda: ChaosExecution.objects.count() >= 6, timeout=30)
    assert sorted(ChaosExecution.objects.values_list("job_id", flat=True)) == sorted(
        job.pk for job in jobs
    )


def test_a_max_running_of_0_runs_nothing_on_a_nats_queue_as_on_any_queue(queue: str) -> None:
    # max_ack_pending = max_running or the default: 0 became "no limit" on a NATS queue, while
    # a PostgreSQL queue with it runs nothing.
    limit = Queue.objects.create(name=queue, max_running=0)
    jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
    relay().round()
    with WorkerThread(queue):
        time.sleep(1.5)  # a few turns of the worker: it must not fetch from the queue
        assert not ChaosExecution.objects.exists()
        Queue.objects.filter(pk=limit.pk).update(max_running=None)
        wait_until(lambda: ChaosExecution.objects.count() >= 3, timeout=30)
    assert len(jobs) == 3


def _consumer(reader: Any, queue: Any) -> Any:
    try:
        return reader.call(reader.js.consumer_info(queue.stream, queue.consumer))
    except nats.js.errors.NotFoundError:
        return None


def test_the_jobs_headers_travel_as_message_headers_to_the_handler(queue: str) -> None:
    job = tasks.reports_its_headers.using(queue=queue).enqueue()
    Job.objects.filter(pk=job.pk).update(headers={"traceparent": "00-4bf92f35-00f067aa-01"})
    relay().round()

    reader = bridge()
    stream = transports.nats_queues()[queue]
    sub = reader.call(
        reader.js.pull_subscribe(stream.subject, durable="peek", stream=stream.stream)
    )
    (msg,) = reader.fetch(sub, 1, 2.0)
    assert msg.headers["traceparent"] == "00-4bf92f35-00f067aa-01"
    assert msg.headers["Nats-Msg-Id"] == f"{job.pk}:0"
    assert msg.headers["Pgjobs-Task"] == job.task

    tasks.seen_headers.clear()
    with WorkerThread(queue):
        seen = wait_until(lambda: list(tasks.seen_headers), timeout=30)
    assert seen == [(job.pk, 1, {"traceparent": "00-4bf92f35-00f067aa-01"})]


def test_a_handler_longer_than_the_lease_keeps_its_message_by_in_progress_acks(
    queue: str,
) -> None:
    job = tasks.ledger.using(queue=queue).enqueue(n=1, seconds=4.5)
    relay().round()
    with WorkerThread(queue, lease=1.5):  # the consumer's ack wait
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        time.sleep(5.0)  # past three ack waits; the handler returns meanwhile
    runs = list(ChaosExecution.objects.values_list("job_id", "attempt"))
    assert runs == [(job.pk, 1)]  # never delivered again
    reader = bridge()
    stream = transports.nats_queues()[queue]
    info = reader.call(reader.js.consumer_info(stream.stream, stream.consumer))
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


def test_a_worker_keeps_its_messages_when_another_shortens_the_shared_ack_wait(
    queue: str,
) -> None:
    # A worker started with a shorter --lease sets the queue's consumer's ack wait for all: a
    # worker with a longer one acknowledged in progress every lease/3 (10 s), and every message
    # it ran was delivered again, and run again, while it ran.
    from django_pgjobs.jetstream import streams

    job = tasks.ledger.using(queue=queue).enqueue(n=1, seconds=4.5)
    relay().round()
    nats_queue_ = transports.nats_queues()[queue]
    with WorkerThread(queue, lease=30.0):
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        streams.ensure_consumer(bridge(), nats_queue_, 1.5, nats_queue_.max_ack_pending)
        time.sleep(5.0)  # past three of the new ack waits; the handler returns meanwhile
    assert list(ChaosExecution.objects.values_list("job_id", "attempt")) == [(job.pk, 1)]


def _shaped(queue: str, **fields: Any) -> bytes:
    """A message of our shape for tests.tasks.ledger, with `fields` changed."""
    now = timezone.now().isoformat()
    return json.dumps({
        "v": 1, "id": str(uuid.uuid4()), "queue": queue, "task": "tests.tasks.ledger",
        "payload": {"n": 5}, "priority": 0, "run_at": now, "created_at": now, "attempts": 0,
        "max_attempts": 3, "claims": 0, "errors": [], "headers": None, **fields,
    }).encode()  # fmt: skip


UNREADABLE = {
    "not JSON": lambda queue: b"not json",
    "nested 100,000 deep": lambda queue: b"[" * 100_000 + b"]" * 100_000,  # RecursionError
    "a JSON list": lambda queue: b"[1, 2]",
    "max_attempts a str": lambda queue: _shaped(queue, max_attempts="3"),
    "attempts past an int4": lambda queue: _shaped(queue, attempts=10**20),
}


@pytest.mark.parametrize("body", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_a_message_the_worker_cannot_read_is_terminated_not_retried(
    queue: str, body: Callable[[str], bytes]
) -> None:
    # Some raised past the worker's reading (RecursionError; a str compared with an int): the
    # message came back every ack wait, and the jobs fetched with it never ran; one whose
    # attempts did not fit the table failed its dead letter's write every turn, for good.
    relay().round()  # makes the stream
    publisher = bridge()
    stream = transports.nats_queues()[queue]
    publisher.publish([(stream.subject, body(queue), {"Nats-Msg-Id": "junk"})])
    job = tasks.ledger.using(queue=queue).enqueue(n=1)
    relay().round()

    def settled() -> Any:
        info = _consumer(publisher, stream)
        return info if info and info.num_ack_pending == 0 and info.num_pending == 0 else None

    with WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.filter(job_id=job.pk).exists(), timeout=30)
        info = wait_until(settled, timeout=30)
    assert info.num_redelivered == 0
    assert ChaosExecution.objects.count() == 1


def test_a_worker_whose_consumer_is_deleted_makes_it_again_and_runs_on(queue: str) -> None:
    # Deleted by hand, or lost with the server's storage: its pulls only timed out, as on an
    # empty queue, and the worker ran nothing more, saying nothing, while the relay moved the
    # jobs out of PostgreSQL into the stream.
    first = tasks.ledger.using(queue=queue).enqueue(n=1)
    relay().round()
    reader = bridge()
    stream = transports.nats_queues()[queue]
    with WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.filter(job_id=first.pk).exists(), timeout=30)
        reader.call(reader.js.delete_consumer(stream.stream, stream.consumer))
        second = tasks.ledger.using(queue=queue).enqueue(n=2)
        relay().round()
        wait_until(lambda: ChaosExecution.objects.filter(job_id=second.pk).exists(), timeout=30)
    assert _consumer(reader, stream) is not None


def test_a_retry_on_the_last_attempt_ends_the_job_saying_so(queue: str) -> None:
    # Announced as retried, it was delivered again and dead-lettered unrun as "WorkerLost:
    # delivered 2 times without an outcome": no worker was lost.
    job = tasks.asks_to_retry.using(queue=queue, max_attempts=1).enqueue(seconds=0.1)
    relay().round()
    with WorkerThread(queue):
        dead = wait_until(lambda: DeadLetter.objects.filter(pk=job.pk).first(), timeout=30)
    assert dead.last_error.startswith("django_pgjobs.RetryExhausted: asked to run again (Retry)")
    assert dead.attempts == 1
