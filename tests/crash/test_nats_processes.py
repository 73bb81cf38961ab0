"""runjobs for a queue carried by NATS, as a real process: it relays its own outbox, runs the
jobs, and stops cleanly on SIGTERM; a PostgreSQL worker relays NATS queues' outboxes too."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.models import ChaosExecution

pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")

from django_pgjobs.models import DeadLetter, Job
from tests import tasks
from tests.integration.nats_helpers import (
    NATS_URL,
    WorkerThread,
    bridge,
    consumer_info,
    nats_queue,
    relay,
    stream_messages,
)

pytestmark = pytest.mark.django_db(transaction=True)


def _env(queue: str) -> dict[str, str]:
    queues = {queue: {"TRANSPORT": "nats", "MAX_AGE": 3600, "DUPLICATE_WINDOW": 60}}
    return {
        "PGJOBS_TEST_QUEUES": json.dumps(queues),
        "PGJOBS_TEST_NATS_SETTINGS": json.dumps({"SERVERS": NATS_URL}),
    }


def test_runjobs_for_a_nats_queue_relays_runs_and_stops_on_sigterm(
    settings: Any, start_worker: Any
) -> None:
    with nats_queue(settings) as queue:
        jobs = Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(30)], queue=queue)
        worker = start_worker("--queue", queue, "--concurrency", "4", env=_env(queue))
        wait_until(lambda: ChaosExecution.objects.count() >= 30, timeout=60)
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert sorted(ChaosExecution.objects.values_list("job_id", flat=True)) == sorted(
            job.pk for job in jobs
        )
        assert f"started: NATS queues={queue} " in worker.log()
        # A first start: no warning that jobs that ran may run again (its own relay may have
        # published the jobs before or after it made its consumer).
        assert "did not exist" not in worker.log()


def test_a_postgresql_worker_relays_the_outbox_of_nats_queues(
    settings: Any, start_worker: Any
) -> None:
    with nats_queue(settings) as queue:
        Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(10)], queue=queue)
        worker = start_worker("--queue", "default", env=_env(queue))
        wait_until(lambda: not Job.objects.filter(queue=queue).exists(), timeout=60)
        assert stream_messages(queue) == 10
        # Once running, the relay takes a committed job within its interval (0.5 s when idle).
        time.sleep(1.0)
        enqueued = time.monotonic()
        tasks.ledger.using(queue=queue).enqueue(n=10)
        wait_until(lambda: not Job.objects.filter(queue=queue).exists(), timeout=10, interval=0.01)
        assert time.monotonic() - enqueued < 1.5
        assert stream_messages(queue) == 11
        assert ChaosExecution.objects.count() == 0  # relayed, not run: no NATS worker runs
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0


def test_runjobs_refuses_nats_and_postgresql_queues_together(
    settings: Any, start_worker: Any
) -> None:
    with nats_queue(settings) as queue:
        worker = start_worker("--queue", queue, "--queue", "default", env=_env(queue))
        assert worker.wait(60) == 1
        assert "run one runjobs for each kind" in worker.log()


def test_nats_workers_run_under_a_supervisor_and_are_recycled_after_max_jobs(
    settings: Any, start_worker: Any
) -> None:
    with nats_queue(settings) as queue:
        payloads = [{"n": n, "seconds": 0.05} for n in range(40)]
        jobs = Job.objects.bulk_enqueue(tasks.ledger, payloads, queue=queue)
        supervisor = start_worker("--queue", queue, "--processes", "2", "--concurrency", "2",
                                  "--max-jobs-per-child", "8", env=_env(queue))  # fmt: skip
        wait_until(lambda: ChaosExecution.objects.values("job_id").distinct().count() >= 40,
                   timeout=90)  # fmt: skip
        assert {job.pk for job in jobs} == set(
            ChaosExecution.objects.values_list("job_id", flat=True)
        )
        assert "recorded 8 outcomes (--max-jobs-per-child)" in supervisor.log()
        assert len(set(ChaosExecution.objects.values_list("pid", flat=True))) > 2  # replaced
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(60) == 0


def test_a_worker_stopped_past_its_ack_wait_does_not_answer_the_delivery_another_runs(
    settings: Any, start_worker: Any
) -> None:
    # Worker A is stopped (SIGSTOP) while it runs attempt 1; past the ack wait the message goes
    # to worker B, which runs attempt 2 (for 1.5 s, within its time limit). A, resumed, met
    # attempt 1's time limit of 2 s and NAKed its old delivery: the server took it as B's and
    # delivered the message a third time while B ran it (dead-lettered at once as "WorkerLost:
    # delivered 3 times", and B's success was lost).
    with nats_queue(settings) as queue:
        job = tasks.overruns_then_retries_quietly.using(queue=queue).enqueue(seconds=1.5)
        relay().round()
        reader = bridge()
        a = start_worker("--queue", queue, "--concurrency", "1", "--lease", "3", "--no-relay",
                         env=_env(queue))  # fmt: skip
        # Stopped well within attempt 1's time limit of 2 s.
        wait_until(lambda: delivered(reader, queue) >= 1, timeout=60, interval=0.01)
        a.signal(signal.SIGSTOP)
        with WorkerThread(queue, concurrency=2, lease=3.0):
            wait_until(lambda: delivered(reader, queue) >= 2, timeout=30)  # B runs attempt 2
            a.signal(signal.SIGCONT)
            wait_until(lambda: "its outcome (error) is not acknowledged" in a.log(), timeout=30)
            wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=60)
            assert delivered(reader, queue) == 2
        assert not DeadLetter.objects.filter(pk=job.pk).exists()
        assert f"job {job.pk} ({job.task}) its outcome (error) is not acknowledged" in a.log()
        # Its one thread abandoned past the time limit (it reports on for 10 s): it is replaced,
        # as a PostgreSQL worker is
        assert a.wait(30) == 75
        assert "threads were abandoned past their time limit" in a.log()


def delivered(reader: Any, queue: str) -> int:
    """How many deliveries the queue's consumer made (redeliveries too)."""
    info = consumer_info(reader, queue)
    return int(info.delivered.consumer_seq) if info else 0
