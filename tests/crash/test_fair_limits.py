"""Queues with a limit share a worker's turns with open queues: a backlog never starves them."""

from __future__ import annotations

import signal

from django_pgjobs.models import Job, Queue
from django_pgjobs.status import Status
from tests.conftest import wait_until


def test_a_limited_queue_is_served_while_an_open_queue_has_a_backlog(start_worker):
    Queue.objects.create(name="limited", max_running=2)
    backlog = ({"n": n, "seconds": 0.05} for n in range(2000))  # ~25 s of work for 4 threads
    Job.objects.bulk_enqueue("tests.tasks.record", backlog)
    limited = ({"n": 10_000 + n, "seconds": 0.05} for n in range(20))
    Job.objects.bulk_enqueue("tests.tasks.record", limited, queue="limited")

    worker = start_worker("--queue", "default", "--queue", "limited", "--concurrency", "4")

    def limited_done() -> bool:
        return Job.objects.filter(queue="limited", status=Status.SUCCEEDED).count() == 20

    wait_until(limited_done, timeout=15)
    # The open queue's backlog was there all along: the limited queue was not served last.
    assert Job.objects.filter(queue="default", status=Status.READY).count() > 0
    assert Job.objects.filter(queue="default", status=Status.SUCCEEDED).count() > 0
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
