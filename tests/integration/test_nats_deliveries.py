"""A NATS worker's deliveries against a real nats-server: acknowledgements that reach the
server or are said not to, and messages given back unstarted without spending an attempt."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from django_pgjobs import PermanentError, task
from django_pgjobs.jetstream.source import NatsSource
from django_pgjobs.models import DeadLetter, Job, Queue
from django_pgjobs.runtime.worker import Worker
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import (
    Proxy,
    WorkerThread,
    consumer_info,
    direct_bridge,
    nats_proxy,
    nats_queue,
    relay,
)
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["nats_proxy"]  # a fixture


@pytest.fixture
def queue(settings: Any) -> Iterator[str]:
    with nats_queue(settings) as name:
        yield name


def through(proxy: Proxy, settings: Any) -> None:
    """Workers made from now on reach NATS through `proxy` (the test's own readers do not)."""
    settings.PGJOBS = {**settings.PGJOBS, "NATS": {"SERVERS": proxy.url}}


def settled(worker: Worker) -> bool:
    """No handler runs, and every attempt that ended has its acknowledgement sent, or waiting
    to be sent again."""
    assert isinstance(worker.source, NatsSource)
    answered = all(delivery.reply for delivery in worker.source.deliveries())
    return not worker.handlers.busy(0) and not len(worker.finished) and answered


def test_an_acknowledgement_sent_while_cut_off_from_nats_is_sent_again_after(
    nats_proxy: Proxy, queue: str, settings: Any
) -> None:
    # Sent and forgotten into a dead link, it was lost without a word: the job was delivered
    # again after its ack wait and ran twice.
    job = tasks.ledger.using(queue=queue).enqueue(n=1, seconds=0.5)
    relay().round()
    through(nats_proxy, settings)
    reader = direct_bridge()
    with WorkerThread(queue, lease=20.0) as worker:
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        nats_proxy.freeze()
        wait_until(lambda: settled(worker), timeout=30)
        nats_proxy.thaw()
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=15)
    assert list(ChaosExecution.objects.values_list("job_id", "attempt")) == [(job.pk, 1)]
    assert consumer_info(reader, queue).num_redelivered == 0


def said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> bool:
    return any(record.levelno == level and text in record.getMessage() for record in caplog.records)


def test_an_acknowledgement_that_never_reaches_nats_is_said_and_its_job_not_run_again(
    nats_proxy: Proxy, queue: str, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: delivered again after its ack wait, the job that had succeeded ran again.
    job = tasks.ledger.using(queue=queue).enqueue(n=1, seconds=0.5)
    relay().round()
    through(nats_proxy, settings)
    reader = direct_bridge()
    unconfirmed = f"job {job.pk} (tests.tasks.ledger) succeeded, but NATS did not confirm"
    again = f"job {job.pk} (tests.tasks.ledger) was delivered again after this worker "
    again += "acknowledged its message: acknowledged again, not run"
    with caplog.at_level(logging.INFO, "django_pgjobs"), WorkerThread(queue, lease=3.0):
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        nats_proxy.freeze()
        wait_until(lambda: said(caplog, logging.WARNING, unconfirmed), timeout=30)
        nats_proxy.thaw()
        wait_until(lambda: said(caplog, logging.INFO, again), timeout=30)
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=15)
    assert list(ChaosExecution.objects.values_list("job_id", "attempt")) == [(job.pk, 1)]
    assert not DeadLetter.objects.filter(pk=job.pk).exists()
    assert Job.objects.filter(pk=job.pk).count() == 0


@task(max_attempts=1)
def runs_then_fails(seconds: float) -> None:
    """One ledger row (ChaosExecution), `seconds`, then a failure: on its one attempt, a dead
    letter."""
    import os
    import time

    from django_pgjobs import current_job

    job = current_job()
    assert job is not None
    ChaosExecution.objects.create(
        job_id=job.pk, attempt=job.attempts, worker=job.worker, pid=os.getpid(), ok=False
    )
    time.sleep(seconds)
    raise PermanentError("failed on purpose")


def test_a_termination_that_never_reaches_nats_is_said_and_its_job_not_run_again(
    nats_proxy: Proxy, queue: str, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: its message delivered again (as nats-server 2.9.10 does even after a confirmed
    # termination), the dead letter ran again.
    job = runs_then_fails.using(queue=queue).enqueue(seconds=0.5)
    relay().round()
    through(nats_proxy, settings)
    reader = direct_bridge()
    name = f"job {job.pk} ({runs_then_fails.name})"
    unconfirmed = f"{name} is ended (written back to PostgreSQL), but NATS did not confirm"
    again = f"{name} was delivered again after this worker terminated its message: terminated "
    again += "again, not run"
    with caplog.at_level(logging.INFO, "django_pgjobs"), WorkerThread(queue, lease=3.0):
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
        nats_proxy.freeze()
        wait_until(lambda: said(caplog, logging.WARNING, unconfirmed), timeout=30)
        nats_proxy.thaw()
        wait_until(lambda: said(caplog, logging.INFO, again), timeout=30)
        wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 0, timeout=15)
    assert list(ChaosExecution.objects.values_list("job_id", "attempt")) == [(job.pk, 1)]
    dead = DeadLetter.objects.get(pk=job.pk)
    assert dead.errors[-1]["type"] == "django_pgjobs.errors.PermanentError"


def warmed_up(queue: str) -> None:
    """Run quick jobs first, so that the worker prefetches beyond its threads (as many as it
    expects them to start within a moment: runtime/policy.prefetch)."""
    tasks.ledger.using(queue=queue)  # the task's module is loaded
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(20)], queue=queue)
    relay().round()
    wait_until(lambda: ChaosExecution.objects.count() >= 20, timeout=30)


def behind_a_long_job(
    worker: Worker, queue: str, seconds: float, **options: Any
) -> tuple[Job, Job]:
    """A job of `seconds` started on the worker's one thread, and one fetched with it (relayed
    after it, `options` for its enqueue), not started. The queue is paused while both are
    relayed, so that the worker fetches them in one pull once it is resumed: fetched one by
    one, on a loaded machine the long job could run past policy.BUSY_AFTER before the next pull,
    which then fetched nothing for its thread."""
    reader = direct_bridge()
    Queue.objects.update_or_create(name=queue, defaults={"paused": True})
    wait_until(lambda: queue not in worker.controls.open, timeout=30)
    long = tasks.ledger.using(queue=queue).enqueue(n=100, seconds=seconds)
    waiting = tasks.ledger.using(queue=queue, **options).enqueue(n=101)
    relay().round()
    Queue.objects.filter(name=queue).update(paused=False)
    wait_until(lambda: ChaosExecution.objects.filter(job_id=long.pk).exists(), timeout=30)
    wait_until(lambda: consumer_info(reader, queue).num_ack_pending == 2, timeout=30)
    return long, waiting


def test_a_stopping_worker_gives_back_a_fetched_message_without_spending_an_attempt(
    queue: str,
) -> None:
    # NAKed, its next delivery counted as an attempt: a job of max_attempts=1 fetched behind a
    # long one was dead-lettered unrun ("WorkerLost: delivered 2 times without an outcome").
    with WorkerThread(queue, concurrency=1) as busy:
        warmed_up(queue)
        long, waiting = behind_a_long_job(busy, queue, 2.0, max_attempts=1)
    assert not ChaosExecution.objects.filter(job_id=waiting.pk).exists()

    with WorkerThread(queue, concurrency=1):
        run = wait_until(lambda: ChaosExecution.objects.filter(job_id=waiting.pk).first(), 30)
    assert run.attempt == 1
    assert not DeadLetter.objects.filter(pk=waiting.pk).exists()
    assert ChaosExecution.objects.filter(job_id=long.pk).count() == 1


def test_messages_fetched_behind_held_up_threads_go_to_an_idle_worker(queue: str) -> None:
    # Kept, in-progress acknowledgements and all, until the long job ended, while another
    # worker of the queue idled.
    with WorkerThread(queue, concurrency=1) as busy:
        warmed_up(queue)
        long, waiting = behind_a_long_job(busy, queue, 4.0, max_attempts=1)
        with WorkerThread(queue, concurrency=1) as idle:
            run = wait_until(
                lambda: ChaosExecution.objects.filter(job_id=waiting.pk).first(), timeout=30
            )
    assert (run.worker, run.attempt) == (idle.id, 1)
    assert ChaosExecution.objects.filter(job_id=long.pk).get().worker == busy.id
