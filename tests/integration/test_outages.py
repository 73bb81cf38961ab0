"""A worker in an outage: a failed turn waits out its pause whatever wakes the loop, a stop or
a supervisor gone still ends it in time, and what it says the trouble is."""

from __future__ import annotations

import os
import threading
import time

import pytest
from django.db import InternalError, OperationalError, connection

from django_pgjobs.models import Job
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status


@pytest.mark.django_db(transaction=True)
def test_a_stop_during_a_long_outage_ends_within_the_grace_not_after_the_next_pause(
    monkeypatch, signal_handlers_restored
):
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, grace=1.0))
    job = Job.objects.enqueue("tests.tasks.noop")
    (claimed,) = Job.objects.claim(["default"], worker=worker.id)
    worker.take([claimed], 1)  # a job in flight: the stop waits for it until the grace ends

    def outage() -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(worker, "settle_and_claim", outage)
    monkeypatch.setattr(policy, "outage_pause", lambda failures: 30.0)  # deep in an outage
    ended = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    time.sleep(0.3)  # the worker is now waiting out its first 30 s pause
    started = time.monotonic()
    worker.stop()
    thread.join(10)

    assert ended, "the worker was still waiting out the outage's pause"
    assert time.monotonic() - started < 1.0 + 2.0
    assert Job.objects.get(pk=job.pk).status != Status.RUNNING  # recorded or released


@pytest.mark.django_db(transaction=True)
def test_a_failed_turn_waits_out_its_pause_whatever_wakes_the_loop(monkeypatch):
    # A batch of outcomes the database refused (a read-only primary after a failover) asks for
    # the claim again, which woke the loop at once: a reconnect every 30 ms while the log said
    # "retrying in 30s". Only a stop ends the pause sooner.
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, grace=1.0))
    turns: list[float] = []

    def refused() -> None:
        turns.append(time.monotonic())
        worker.poll_now()  # as settling does before recording outcomes one by one
        raise InternalError("cannot execute UPDATE in a read-only transaction")

    monkeypatch.setattr(worker, "settle_and_claim", refused)
    monkeypatch.setattr(policy, "outage_pause", lambda failures: 0.5)
    thread = threading.Thread(target=worker.run)
    thread.start()
    time.sleep(2.0)  # the window the turns are counted in
    worker.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert 2 <= len(turns) <= 6, len(turns)  # every 0.5 s, not hundreds


@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_supervisor_is_gone_stops_during_an_outage_too(monkeypatch):
    # The turn read the queue controls, a statement, before it looked for its supervisor: an
    # orphaned worker served on for as long as the database was unreachable.
    worker = Worker(Options(queues=["default"], listen=False, parent_pid=os.getpid()))

    def unreachable(db: str) -> bool:
        raise OperationalError("connection refused")

    monkeypatch.setattr(worker.controls, "read_if_due", unreachable)
    with pytest.raises(OperationalError):
        worker._turn()
    assert worker._stopping


@pytest.mark.django_db(transaction=True)
def test_an_orphaned_worker_stops_while_it_pauses_after_a_failed_turn(monkeypatch):
    # The supervisor was looked for at the start of each turn only, and a failed turn's pause
    # lasts up to 30 s: an orphan served on for that long during an outage.
    from django_pgjobs.runtime import lifecycle as stopping

    parent, gone = os.getppid(), threading.Event()
    monkeypatch.setattr(stopping.os, "getppid", lambda: 1 if gone.is_set() else parent)
    worker = Worker(Options(queues=["default"], listen=False, parent_pid=parent))

    def unreachable() -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(worker, "settle_and_claim", unreachable)
    monkeypatch.setattr(policy, "outage_pause", lambda failures: 30.0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    time.sleep(0.5)  # in its pause
    gone.set()
    thread.join(5)
    assert not thread.is_alive()
    assert worker._stopping


@pytest.mark.django_db(transaction=True)
def test_a_statement_timeout_is_said_to_be_one_not_an_unreachable_database():
    from django_pgjobs.runtime.reporting import Outage

    with pytest.raises(OperationalError) as raised, connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '10ms'")
        cursor.execute("SELECT pg_sleep(1)")
    connection.close()
    assert Outage().describe(raised.value) == (
        "a statement ran out of time (canceling statement due to statement timeout)"
    )


def test_a_transaction_the_database_rolled_back_is_not_said_to_be_an_unreachable_database():
    import psycopg

    from django_pgjobs.runtime.reporting import Outage

    error = OperationalError("could not serialize access due to concurrent update")
    error.__cause__ = psycopg.errors.SerializationFailure("could not serialize access")
    assert Outage().describe(error) == (
        "the database rolled a transaction back (could not serialize access due to concurrent "
        "update)"
    )
