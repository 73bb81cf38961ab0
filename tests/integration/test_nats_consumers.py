"""A queue's durable consumer made by a worker, against a real nats-server: at start-up, and
again after it went away while the worker ran."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from django_pgjobs import transports
from django_pgjobs.jetstream.source import ACK_WAIT_CHECK
from django_pgjobs.models import Job, Queue
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import (
    WorkerThread,
    bridge,
    consumer_info,
    nats,
    nats_queue,
    queue,
    relay,
)
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["queue"]  # a fixture


def five_relayed(queue: str) -> tuple[list[Job], Any, Any]:
    """Five jobs of `queue` relayed to its stream; a bridge to read it, and the queue's NATS
    settings."""
    first = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(5)], queue=queue)
    relay().round()
    return first, bridge(), transports.nats_queues()[queue]


def ran_and_acknowledged(reader: Any, queue: str, count: int) -> None:
    """Wait until `count` jobs ran and the queue's consumer acknowledged them in order."""
    wait_until(lambda: ChaosExecution.objects.count() >= count, timeout=30)
    wait_until(lambda: consumer_info(reader, queue).ack_floor.stream_seq == count, timeout=10)


def test_a_consumer_deleted_while_a_worker_runs_is_made_again_after_what_it_acknowledged(
    queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: it was made again delivering every message of the stream, and under the
    # default "limits" retention every job of the last MAX_AGE (7 days) ran again.
    first, reader, stream = five_relayed(queue)
    with caplog.at_level(logging.WARNING, "django_pgjobs"), WorkerThread(queue):
        ran_and_acknowledged(reader, queue, 5)
        time.sleep(ACK_WAIT_CHECK * 1.5)  # the worker reads its consumer again meanwhile
        reader.call(reader.js.delete_consumer(stream.stream, stream.consumer))
        wait_until(lambda: consumer_info(reader, queue) is not None, timeout=10)
        second = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(2)], queue=queue)
        relay().round()
        wait_until(lambda: ChaosExecution.objects.count() >= 7, timeout=30)
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=10)
    runs = sorted(ChaosExecution.objects.values_list("job_id", flat=True))
    assert runs == sorted(job.pk for job in [*first, *second])  # each once
    assert consumer_info(reader, queue).config.opt_start_seq == 6
    said = [r.getMessage() for r in caplog.records if "made the consumer" in r.getMessage()]
    assert len(said) == 1 and "from stream sequence 6 on" in said[0]


def test_a_consumer_deleted_twice_with_no_acknowledgement_between_is_made_again_after_both(
    queue: str,
) -> None:
    # Before: the server says an ack floor of 0 for a consumer made to start at a sequence
    # until its first acknowledgement; deleted again before that, it was made again from the
    # stream's first message, and every job the stream held ran again (attack 15).
    first, reader, stream = five_relayed(queue)

    def delete_and_wait_for_it_again() -> Any:
        time.sleep(ACK_WAIT_CHECK * 1.5)  # the worker reads its consumer meanwhile
        reader.call(reader.js.delete_consumer(stream.stream, stream.consumer))
        return wait_until(lambda: consumer_info(reader, queue), timeout=10)

    with WorkerThread(queue):
        ran_and_acknowledged(reader, queue, 5)
        assert delete_and_wait_for_it_again().config.opt_start_seq == 6
        assert delete_and_wait_for_it_again().config.opt_start_seq == 6  # idle: no ack between
        second = tasks.ledger.using(queue=queue).enqueue(n=9)
        relay().round()
        wait_until(lambda: ChaosExecution.objects.count() >= 6, timeout=30)
        time.sleep(1)  # what ran again would run by now
    runs = sorted(ChaosExecution.objects.values_list("job_id", flat=True))
    assert runs == sorted(job.pk for job in [*first, second])  # each once


def test_a_stream_made_again_while_a_worker_runs_has_every_message_delivered(
    queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The consumer (gone with its stream) was made again after the old stream's ack floor:
    # the new stream's first messages, their outbox rows deleted, never ran (attack 13).
    first, reader, stream = five_relayed(queue)
    with caplog.at_level(logging.INFO, "django_pgjobs"), WorkerThread(queue) as worker:
        ran_and_acknowledged(reader, queue, 5)
        Queue.objects.update_or_create(name=queue, defaults={"paused": True})
        wait_until(lambda: queue not in worker.controls.open, timeout=30)
        Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
        relay().round()  # lost with the stream, unrun
        wait_until(lambda: consumer_info(reader, queue).num_pending == 3, timeout=10)
        time.sleep(ACK_WAIT_CHECK * 1.5)  # the worker reads its consumer meanwhile
        reader.call(reader.js.delete_stream(stream.stream))  # `nats stream rm`, say
        Queue.objects.filter(name=queue).update(paused=False)
        second = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(2)], queue=queue)
        relay().round()  # makes the stream again: its sequences start at 1
        wait_until(lambda: ChaosExecution.objects.count() >= 7, timeout=30)
    runs = sorted(ChaosExecution.objects.values_list("job_id", flat=True))
    assert runs == sorted(job.pk for job in [*first, *second])
    # Said once, with what the stream took with it; its consumer made again is no warning.
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    lost = [said for said in warned if f"the stream {stream.stream} of queue" in said]
    assert len(lost) == 1, warned
    assert "every message it held is lost with it (3 were pending as its consumer was last " \
        "read: 3 not yet delivered, which never run, and 0 delivered" in lost[0]  # fmt: skip
    assert not [said for said in warned if "made the consumer" in said or "did not" in said]


def test_a_first_start_on_jobs_relayed_before_it_says_so_plainly_not_as_a_warning(
    queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: a queue's first NATS worker warned that jobs that ran might run again.
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
    relay().round()
    with caplog.at_level(logging.INFO, "django_pgjobs"), WorkerThread(queue) as worker:
        wait_until(lambda: ChaosExecution.objects.count() >= 3, timeout=30)
    nats = [r for r in caplog.records if r.name.startswith("django_pgjobs.jetstream")]
    assert not [r.getMessage() for r in nats if r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in nats if "made the consumer" in r.getMessage()]
    assert said == [
        f"worker {worker.id}: made the consumer pgjobs_{queue} of queue {queue!r} on its new "
        f"stream PGJOBS_{queue}: it delivers the 3 messages relayed so far (sequences 1 to 3)"
    ]


def test_a_worker_that_finds_no_consumer_on_an_older_stream_warns_that_jobs_may_run_again(
    queue: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A consumer deleted while no worker ran, or CONSUMER renamed: every message is delivered,
    # those that ran too, and that is said.
    from django_pgjobs.jetstream import streams

    monkeypatch.setattr(streams, "NEW_STREAM", 0.0)  # older than the worker: not new
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
    relay().round()
    time.sleep(0.1)  # the stream was made before the worker starts, by more than the clock's step
    with caplog.at_level(logging.WARNING, "django_pgjobs"), WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.count() >= 3, timeout=30)
    said = [r.getMessage() for r in caplog.records if "did not exist" in r.getMessage()]
    assert len(said) == 1 and "(3, sequences 1 to 3)" in said[0]


def test_under_workqueue_retention_a_missing_consumer_is_not_said_to_run_jobs_again(
    settings: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # There a message is gone once acknowledged: what a new consumer delivers never ran.
    from django_pgjobs.jetstream import streams

    monkeypatch.setattr(streams, "NEW_STREAM", 0.0)  # not new: the rule for workqueue, not age
    with nats_queue(settings, RETENTION="workqueue") as queue:
        Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
        relay().round()
        time.sleep(0.1)
        with caplog.at_level(logging.WARNING, "django_pgjobs"), WorkerThread(queue):
            wait_until(lambda: ChaosExecution.objects.count() >= 3, timeout=30)
    assert not [r for r in caplog.records if "did not exist" in r.getMessage()]


def test_a_worker_keeps_where_an_existing_consumer_starts(queue: str) -> None:
    # The server refuses to change a consumer's deliver policy: a worker starting on a
    # consumer made from a sequence (by a worker, or by hand as graduating.md says) must update
    # it as it is, not fail at every turn.
    from django_pgjobs.jetstream import streams

    jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)
    relay().round()
    nats_queue_ = transports.nats_queues()[queue]
    made = bridge()
    config = streams.consumer_config(nats_queue_, 30.0, 10)
    config.deliver_policy, config.opt_start_seq = nats.js.api.DeliverPolicy.BY_START_SEQUENCE, 3
    made.call(made.js.add_consumer(nats_queue_.stream, config))
    with WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        wait_until(lambda: consumer_info(made, queue).num_ack_pending == 0, timeout=10)
    assert list(ChaosExecution.objects.values_list("job_id", flat=True)) == [jobs[2].pk]
    assert consumer_info(made, queue).config.opt_start_seq == 3


def test_a_short_lease_with_a_long_poll_runs_each_job_once(queue: str) -> None:
    # A message that came late in a fetch's wait (up to the poll interval) was past its fence
    # already: a job that succeeded in milliseconds ran again and again, then was dead-lettered
    # as lost (attack 13: --lease 1; --lease 3 --poll-interval 5).
    jobs = []
    with WorkerThread(queue, lease=1.0, poll_interval=5.0, stats_interval=30.0):
        for n in range(3):  # each at some moment of the worker's wait
            time.sleep(1.3)
            jobs += Job.objects.bulk_enqueue(tasks.ledger, [{"n": n}], queue=queue)
            relay().round()
        wait_until(lambda: ChaosExecution.objects.count() >= 3, timeout=30)
        time.sleep(2.0)  # past an ack wait: anything delivered again would have run by now
    runs = sorted(ChaosExecution.objects.values_list("job_id", flat=True))
    assert runs == sorted(job.pk for job in jobs)
