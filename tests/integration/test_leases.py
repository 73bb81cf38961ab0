"""Leases that the lease keeper (runtime/leases.py) cannot renew, or no longer would: the main
loop renews them meanwhile, and a finished job keeps its lease until its outcome is recorded."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import OperationalError

from django_pgjobs.models import Job
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.integration.test_thread_resilience import read_only  # noqa: F401


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("read_only")  # the lease keeper's sessions
def test_while_the_lease_keeper_cannot_renew_leases_the_main_loop_renews_them(caplog):
    # With no connection left for its lease keeper (a reconnect storm after a failover fills
    # max_connections), a worker claimed and ran on while its leases ran out: other workers'
    # reapers took its jobs and ran them again, and two live workers dead-lettered them as
    # lost. The keeper's sessions are read-only here; the main loop's work.
    # Renewed from 1.5 s after a heartbeat (at 1 s) went missing, the lease ends at 3 s: room for
    # a loaded machine. The job outlives two leases.
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 6.5})
    worker = Worker(
        Options(queues=["default"], concurrency=2, listen=False, lease=3.0, poll_interval=0.2)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    reaped: list[tuple[int, int]] = []
    try:

        def done() -> bool:
            reaped.append(Job.objects.reap()[:2])  # another worker's reaper, all along
            return Job.objects.get(pk=job.pk).status == Status.SUCCEEDED

        wait_until(done, timeout=30, interval=0.3)
    finally:
        worker.stop()
        thread.join(10)
    assert Job.objects.get(pk=job.pk).attempts == 1
    assert set(reaped) == {(0, 0)}
    assert "the worker's main loop renews them" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_finished_job_keeps_its_lease_until_its_outcome_is_recorded(monkeypatch):
    # The lease keeper renewed only the claims whose handlers still ran: a job that had
    # finished while the main loop could not record (its turns failing, the lease keeper's
    # connection fine) ran out its lease; another worker's reaper took it back and it ran
    # again, its first outcome then refused as lost.
    job = Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(
        Options(queues=["default"], concurrency=1, listen=False, lease=3.0, poll_interval=0.2)
    )
    cut_off, restored = threading.Event(), threading.Event()
    settle = worker.settle_and_claim

    def failing() -> None:
        if worker.claims and not restored.is_set():
            cut_off.set()
            raise OperationalError("server closed the connection unexpectedly")
        settle()

    monkeypatch.setattr(worker, "settle_and_claim", failing)
    monkeypatch.setattr(policy, "outage_pause", lambda failures: 0.5)
    thread = threading.Thread(target=worker.run)
    thread.start()
    reaped: list[tuple[int, int]] = []
    try:
        cut_off.wait(10)
        until = time.monotonic() + 7.0  # two leases and more
        while time.monotonic() < until:
            reaped.append(Job.objects.reap()[:2])  # another worker's reaper, all along
            time.sleep(0.3)
        restored.set()
        wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.SUCCEEDED, 10)
    finally:
        worker.stop()
        thread.join(10)
    assert set(reaped) == {(0, 0)}
    assert Job.objects.get(pk=job.pk).attempts == 1
