"""Queue controls and cancellation across real `runjobs` processes: a pause reaches every worker,
a per-queue limit holds across all of them, and a running job's cancellation is observed."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from django_pgjobs.models import Job, Queue
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def count(status: str) -> int:
    return Job.objects.filter(status=status).count()


def stop(workers) -> None:
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert [worker.wait(20) for worker in workers] == [0] * len(workers)


def test_a_running_job_sees_its_cancellation_and_is_recorded_cancelled(start_worker):
    job = Job.objects.enqueue("tests.tasks.until_cancelled", {"n": 5})
    worker = start_worker()
    wait_until(lambda: Execution.objects.filter(n=5).exists(), timeout=20)
    assert Job.objects.filter(pk=job.pk).cancel() == [job.pk]
    wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.CANCELLED, timeout=10)
    assert Execution.objects.filter(n=-5).exists()  # the handler observed it and stopped
    row = Job.objects.get(pk=job.pk)
    assert (row.attempts, row.errors[-1]["type"]) == (1, "django_pgjobs.errors.JobCancelled")
    assert "cancelled=1" in stop_and_log(worker)


def stop_and_log(worker) -> str:
    stop([worker])
    return worker.log()


#: What a worker logs (at DEBUG) each time it reads the controls and finds its queue paused.
PAUSED = "paused queues: default"


def test_pausing_a_queue_stops_claims_on_every_worker_until_it_resumes(start_worker):
    debug = {"PGJOBS_TEST_LOG_LEVEL": "DEBUG"}
    workers = [start_worker("--concurrency", "2", env=debug) for _ in range(3)]
    wait_until(lambda: all(worker.started() for worker in workers), timeout=20)
    Queue.objects.create(name="default", paused=True)
    wait_until(lambda: all(PAUSED in worker.log() for worker in workers), timeout=10)
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n} for n in range(30)))
    reads = [worker.log().count(PAUSED) for worker in workers]
    # Nothing is meant to happen now, so there is nothing to wait for: let 4 s pass on
    # purpose, checking all along that no worker claims from the paused queue...
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert count(Status.READY) == 30, "a worker claimed from a paused queue"
        time.sleep(0.1)
    # ...while every worker was awake, reading the controls again and finding the pause.
    assert all(worker.alive() for worker in workers)
    reads_after = [worker.log().count(PAUSED) for worker in workers]
    assert all(after > before for after, before in zip(reads_after, reads, strict=True)), (
        f"controls read before/after the 4 s: {reads} / {reads_after}"
    )
    Queue.objects.filter(name="default").update(paused=False)
    wait_until(lambda: count(Status.SUCCEEDED) == 30, timeout=30)
    stop(workers)


def test_the_per_queue_limit_is_never_exceeded_across_workers_under_load(
    start_worker, other_connection
):
    Queue.objects.create(name="default", max_running=3)
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n, "seconds": 0.05} for n in range(120)))
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:  # a second session counts the queue's running jobs, over and over
        while not done.is_set():
            (running,) = other_connection.execute(
                "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND queue = 'default'"
            ).fetchone()
            samples.append(running)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [start_worker("--concurrency", "4") for _ in range(3)]
    try:
        wait_until(lambda: count(Status.SUCCEEDED) == 120, timeout=90)
    finally:
        done.set()
        sampler.join()
    stop(workers)
    assert len(samples) > 100
    assert max(samples) == 3, f"running at once: max {max(samples)} over {len(samples)} samples"
    assert len(set(Execution.objects.values_list("pid", flat=True))) > 1  # shared by workers
