"""Hostile input and operators, in-process: what must never wedge, loop or fail as a whole."""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import (
    InterfaceError,
    InternalError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.models import F

from django_pgjobs import Retry, validation
from django_pgjobs.data.records import Failure
from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime import execute, policy
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.integration.test_thread_resilience import read_only  # noqa: F401


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"delay": 1e17}, "at most"),
        ({"delay": timedelta(days=100_000_000)}, "at most"),
        ({"run_at": datetime.max.replace(tzinfo=timezone(-timedelta(hours=23)))}, "out of range"),
        ({"payload": {"deep": _nested(100)}}, "levels deep"),
        ({"payload": {"n": 10**5000}}, "bits"),
        ({"run_at": datetime.min.replace(tzinfo=UTC)}, "out of range"),
        ({"run_at": datetime.max.replace(tzinfo=UTC)}, "out of range"),
        ({"max_attempts": 2**32 + 3}, "from 1 to 2147483647"),
        ({"max_attempts": 2**31}, "from 1 to 2147483647"),
    ],
    ids=[
        "delay 1e17 s",
        "delay 1e8 days",
        "run_at past 9999 in UTC",
        "nested 100 deep",
        "huge int",
        "run_at year 1 in UTC (year 0 in New York)",
        "run_at 9999-12-31 in UTC (year 10000 in Tokyo)",
        "max_attempts past an int4, wrapped by a COPY",
        "max_attempts just past an int4",
    ],
)
def test_input_no_query_could_load_again_is_refused_and_the_transaction_goes_on(options, words):
    with transaction.atomic():
        with pytest.raises(EnqueueError, match=words):
            Job.objects.enqueue("tests.tasks.noop", **options)
        # Refused before anything reached the database: the caller's transaction is intact.
        assert Job.objects.count() == 0
        Job.objects.enqueue("tests.tasks.noop")
    assert Job.objects.count() == 1


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "100", True])
def test_bulk_enqueue_refuses_a_batch_size_that_is_not_a_count(batch_size):
    # -1 wrote nothing and returned []; 0 raised range()'s ValueError after a statement ran.
    with pytest.raises(EnqueueError, match=r"batch_size=.* must be an integer of 1 or more"):
        Job.objects.bulk_enqueue("tests.tasks.noop", [{}, {}], batch_size=batch_size)


@pytest.mark.django_db
def test_bulk_enqueue_refuses_max_attempts_a_copy_would_wrap():
    with pytest.raises(EnqueueError, match="from 1 to 2147483647"):
        Job.objects.bulk_enqueue("tests.tasks.noop", [{}], max_attempts=2**32 + 3)
    assert not Job.objects.exists()


@pytest.fixture
def zoned(request):
    """The test's connection, reading times in `request.param`'s zone (DATABASES' TIME_ZONE,
    which Django allows with USE_TZ)."""

    def reconnect(zone: str | None) -> None:
        connection.close()
        connection.settings_dict["TIME_ZONE"] = zone
        for cached in ("timezone", "timezone_name"):
            connection.__dict__.pop(cached, None)

    saved = connection.settings_dict.get("TIME_ZONE")
    reconnect(request.param)
    yield Job.objects
    reconnect(saved)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("zoned", ["America/New_York", "Asia/Tokyo"], indirect=True)
def test_the_earliest_and_latest_run_at_load_in_the_time_zone_a_connection_reads_them_in(zoned):
    # run_at=datetime.min in UTC passed the check, then its row could not be read in New York
    # (year 0): the enqueue raised after the INSERT committed, and a worker's claim that took
    # the job committed, failed reading its rows, and every job of that batch ran out its lease.
    for when in (validation.EARLIEST, validation.LATEST):
        assert zoned.enqueue("tests.tasks.noop", run_at=when).run_at == when
    early = zoned.enqueue("tests.tasks.noop")
    with connection.cursor() as cursor:  # to the front of the queue, by hand
        cursor.execute("UPDATE pgjobs_job SET run_at = '-infinity' WHERE id = %s", [early.pk])
    claimed = zoned.claim(["default"], worker="w1", limit=10)
    assert {job.run_at for job in claimed} == {validation.EARLIEST}
    assert len(claimed) == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "written",
    [
        "('{\"n\": ' || repeat('9', 5000) || '}')::jsonb",  # past Python's 4,300 digits
        "('{\"deep\": ' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb",
    ],
    ids=["5000-digit integer", "nested 5000 deep"],
)
def test_a_payload_python_cannot_read_fails_its_job_alone(written):
    # Written by SQL (enqueue refuses both): the claim committed, then reading its rows failed,
    # and every job claimed with it ran out its lease, an attempt spent, claim after claim.
    poison = Job.objects.enqueue("tests.tasks.noop", priority=10)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE pgjobs_job SET payload = {written} WHERE id = %s", [poison.pk])
    others = [Job.objects.enqueue("tests.tasks.noop") for _ in range(3)]
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True))
    worker.run()
    rows = Job.objects.values_list("pk", "status", "attempts", "last_error")  # not the payload
    outcomes = {pk: (status, attempts, error) for pk, status, attempts, error in rows}
    status, attempts, error = outcomes.pop(poison.pk)
    assert (status, attempts) == (Status.FAILED, 1)
    assert "its payload cannot be read in Python" in error
    assert {(status, attempts) for status, attempts, _ in outcomes.values()} == {
        (Status.SUCCEEDED, 1)
    }
    assert len(outcomes) == len(others)


def test_retry_refuses_a_delay_no_timestamp_can_hold():
    for delay in (math.inf, 1e17, timedelta(days=100_000_000), "soon"):
        with pytest.raises(ValueError, match="Retry"):
            Retry(delay)  # type: ignore[arg-type]


@pytest.mark.django_db
def test_replaying_dead_letters_that_share_a_key_replays_the_oldest_and_skips_the_rest():
    first = Job.objects.enqueue("tests.tasks.noop", unique_key="order-7")
    Job.objects.filter(pk=first.pk).cancel()
    second = Job.objects.enqueue("tests.tasks.noop", unique_key="order-7")
    Job.objects.filter(pk=second.pk).cancel()
    other = Job.objects.enqueue("tests.tasks.noop")
    Job.objects.filter(pk=other.pk).cancel()

    replayed = Job.objects.all().replay()

    assert sorted(replayed) == sorted([first.pk, other.pk])
    assert Job.objects.get(pk=second.pk).status == Status.CANCELLED
    # Again: the key is held by the replayed job now, so nothing more is replayed.
    assert Job.objects.all().replay() == []


class ReadReplicaRouter:
    """Reads from "replica", a second connection that cannot see the test's uncommitted rows:
    a replica that is behind."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_relation(self, *objects: Any, **hints: Any) -> bool:
        return True


@pytest.fixture
def replica():
    connections.settings["replica"] = copy.deepcopy(connection.settings_dict)
    yield
    connections["replica"].close()
    del connections["replica"]
    del connections.settings["replica"]


@pytest.mark.django_db
def test_a_held_key_is_found_on_the_write_database_behind_a_lagging_read_replica(settings, replica):
    holder = Job.objects.enqueue("tests.tasks.noop", unique_key="invoice-1")
    settings.DATABASE_ROUTERS = [ReadReplicaRouter()]

    again = Job.objects.enqueue("tests.tasks.noop", unique_key="invoice-1")

    assert again.pk == holder.pk


@pytest.mark.django_db
def test_cancel_requested_asks_the_write_database_not_a_lagging_read_replica(settings, replica):
    from django_pgjobs import cancel_requested

    Job.objects.enqueue("tests.tasks.noop")
    (job,) = Job.objects.claim(["default"], worker="w1")
    Job.objects.filter(pk=job.pk).cancel()  # not on the replica yet
    settings.DATABASE_ROUTERS = [ReadReplicaRouter()]

    with execute.running(job):
        assert cancel_requested()


@pytest.mark.django_db(transaction=True)  # the check asks from a thread of its own
def test_cancel_requested_works_in_an_async_handler():
    Job.objects.enqueue("tests.hostile.checks_for_cancellation_asynchronously")
    (job,) = Job.objects.claim(["default"], worker="w1")
    Job.objects.filter(pk=job.pk).cancel()

    handled = execute.run(job)

    assert handled.failure is not None
    assert handled.failure.type == "django_pgjobs.errors.JobCancelled", handled.failure


@pytest.fixture
def stubborn_tasks_ended():
    from tests import hostile

    hostile.stubborn_tasks_end.clear()
    yield
    hostile.stubborn_tasks_end.set()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stubborn_tasks_ended")
def test_an_async_handler_leaving_a_task_that_ignores_cancellation_has_its_own_outcome(caplog):
    # asyncio.run cancels the tasks a coroutine left and waits for them to end: the handler
    # thread waited for good, the job stayed running (or was recorded as timed out under a time
    # limit) and the jobs behind it waited for that thread.
    stubborn = Job.objects.enqueue("tests.hostile.leaves_a_task_that_ignores_cancellation")
    after = [Job.objects.enqueue("tests.hostile.checks_for_cancellation_asynchronously")]
    after += [Job.objects.enqueue("tests.tasks.noop") for _ in range(3)]
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(
            lambda: set(Job.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}, 20
        )
        assert not worker._stopping  # one companion thread left: fewer than the two threads
    finally:
        worker.stop()
        thread.join(10)
    assert "leaving tasks that did not end within" in caplog.text
    assert str(stubborn.pk) in caplog.text
    assert Job.objects.get(pk=stubborn.pk).attempts == 1


@pytest.mark.django_db(transaction=True)
def test_an_async_handlers_error_has_the_traceback_of_its_coroutine_not_of_two_threads():
    # Raised again in the companion thread, the same exception object collected that thread's
    # frames as well as the handler thread's: a traceback interleaving both.
    Job.objects.enqueue("tests.hostile.raises_in_its_coroutine")
    (job,) = Job.objects.claim(["default"], worker="w1")
    handled = execute.run(job)
    assert handled.failure is not None
    trace = handled.failure.traceback
    assert trace.rstrip().endswith("ValueError: raised in the coroutine"), trace
    assert "in raises_in_its_coroutine" in trace
    assert "in _serve" not in trace and "base_events.py" not in trace, trace


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_whose_companion_fails_before_its_coroutine_still_ends(monkeypatch):
    # Its companion thread's look at its connections raised before the coroutine ran: the
    # companion ended, the answer never came, and the handler thread waited on it for good.
    def unusable() -> None:
        raise InterfaceError("connection already closed")

    monkeypatch.setattr(execute, "close_old_connections", unusable)
    Job.objects.enqueue("tests.tasks.async_noop", {"value": 1})
    (job,) = Job.objects.claim(["default"], worker="w1")
    handled: list[Handled] = []

    def handler_thread() -> None:
        handled.append(execute.run(job))
        execute.release_awaiter()  # as a handler thread does when it ends

    thread = threading.Thread(target=handler_thread, daemon=True)
    thread.start()
    thread.join(10)
    assert handled and handled[0].failure is not None
    assert handled[0].failure.type.endswith("InterfaceError")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stubborn_tasks_ended")
def test_an_async_handlers_leftovers_recycle_the_worker_once_they_pile_up():
    # Like threads abandoned past their time limits: each left companion holds a thread, its
    # event loop and maybe a connection; as many as the worker has threads and it is replaced.
    for _ in range(2):
        Job.objects.enqueue("tests.hostile.leaves_a_task_that_ignores_cancellation")
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True))
    assert worker.run() == Exit.RECYCLE
    assert list(Job.objects.values_list("status", flat=True)) == [Status.SUCCEEDED] * 2


@pytest.mark.django_db(transaction=True)
def test_an_outcome_the_database_refuses_is_dead_lettered_and_the_others_are_recorded():
    for _ in range(3):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=3))
    jobs = Job.objects.claim(["default"], worker=worker.id, limit=3)
    worker.take(jobs, 3)
    ok = Handled(Verdict.SUCCEEDED)
    # A delay no interval can hold, as a handler's outcome could carry before delays were
    # checked where they are made: the batch's statement fails on it.
    refused = Handled(Verdict.ERROR, delay=1e300, failure=Failure("RuntimeError", "boom"))
    for job, handled in zip(jobs, [ok, refused, ok], strict=True):
        worker.hand_in(job, handled)

    worker.settle_and_claim()

    statuses = {job.pk: Job.objects.get(pk=job.pk) for job in jobs}
    assert statuses[jobs[0].pk].status == statuses[jobs[2].pk].status == Status.SUCCEEDED
    dead = statuses[jobs[1].pk]
    assert dead.status == Status.FAILED
    assert "OutcomeRefused" in dead.last_error and "boom" not in dead.last_error
    assert not worker.claims
    assert datetime.now(UTC) > dead.finished_at


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

    monkeypatch.setattr(worker, "_turn", outage)
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


class _Failing(Chore):
    """A chore whose statement the database refuses every time (a table it may not use)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def run(self) -> float:
        self.runs += 1
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM pgjobs_no_such_table")
        return 1.0


@pytest.mark.django_db(transaction=True)
def test_a_chore_the_database_refuses_is_tried_again_after_its_own_pause_and_fails_nothing_else(
    caplog,
):
    chore = _Failing()
    chore.run_if_due()  # no error raised into the worker's turn
    assert chore.runs == 1 and 0 < chore.due_in() <= policy.outage_pause(1)
    chore.run_if_due()  # not due yet: not run
    assert chore.runs == 1
    chore.next_at = 0
    chore.run_if_due()
    assert chore.runs == 2 and policy.outage_pause(1) < chore.due_in() <= policy.outage_pause(2)
    assert "_Failing failed (ProgrammingError: relation" in caplog.text
    assert "_Failing failed again (2 times" in caplog.text
    Job.objects.enqueue("tests.tasks.noop")  # the connection serves the worker's statements
    assert len(Job.objects.claim(["default"], worker="w1", limit=1)) == 1


@pytest.mark.django_db
def test_claims_the_caller_never_sees_are_given_back_at_once():
    """A Job model signal's receiver that raises while claimed rows become Job objects: the
    claims were committed; they go back to ready at once, the attempt not spent."""
    from django.db.models.signals import post_init

    from tests.factories import JobFactory

    def broken(sender: Any, instance: Job, **kwargs: Any) -> None:
        if instance.payload == {"poison": 1}:
            raise RuntimeError("post_init receiver bug")

    job = JobFactory(payload={"poison": 1})
    post_init.connect(broken, sender=Job)
    try:
        with pytest.raises(RuntimeError, match="post_init receiver bug"):
            Job.objects.claim(["default"], worker="w1", limit=5)
    finally:
        post_init.disconnect(broken, sender=Job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempts, row.claims) == (Status.READY, 0, 1)


@pytest.mark.django_db
def test_claimed_jobs_are_the_workers_before_anything_else_is_done_with_them(monkeypatch):
    """Renewing the claim of a task with a longer lease may fail (the database): the jobs are
    the worker's by then, to be run and renewed, not left to run out their leases."""
    from tests.factories import JobFactory

    JobFactory(task="tests.hostile.has_a_long_lease")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False))
    (job,) = Job.objects.claim(["default"], worker=worker.id, limit=1)

    def fails(claims: list[Job]) -> set[Any]:
        raise OperationalError("the database went away")

    monkeypatch.setattr(worker.source.leases, "renew", fails)
    with pytest.raises(OperationalError):
        worker.take([job], 1)
    assert [claim.job for claim in worker.claims.all()] == [job]


class _TimesOut(Chore):
    def run(self) -> float:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '10ms'")
            cursor.execute("SELECT pg_sleep(1)")
        return 1.0


class _LosesItsConnection(Chore):
    def run(self) -> float:
        raise OperationalError("server closed the connection unexpectedly")


@pytest.mark.django_db(transaction=True)
def test_a_chore_that_runs_out_of_time_pauses_alone_and_a_lost_connection_is_the_workers():
    slow = _TimesOut()
    slow.run_if_due()  # QueryCanceled: the statement's, not the connection's
    assert slow.failures == 1
    with pytest.raises(OperationalError):
        _LosesItsConnection().run_if_due()  # the worker's outage, as before


@pytest.mark.django_db(transaction=True)
def test_taking_back_a_dead_workers_jobs_passes_over_a_row_locked_elsewhere(other_connection):
    # A supervisor takes back a dead child's jobs on its own loop: a row lock held elsewhere
    # (an application's select_for_update in an open transaction) stopped it restarting
    # children and honouring SIGTERM for as long as the lock was held.
    from tests.factories import JobFactory

    JobFactory.create_batch(3)
    locked, *others = Job.objects.claim(["default"], worker="dead", limit=3)
    with connection.cursor() as cursor:  # this session's wait, should there be one, fails
        cursor.execute("SET lock_timeout = '2s'")
    with other_connection.transaction():
        other_connection.execute("SELECT FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        assert Job.objects.abandon("dead", "its process died")[:2] == (2, 0)
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert statuses[locked.pk] == Status.RUNNING  # left to the reaper, at its lease's end
    assert {statuses[job.pk] for job in others} == {Status.READY}


def running(count: int) -> tuple[Worker, list[Job]]:
    """A worker (not started) and `count` no-op jobs it claimed and handed to its threads."""
    for _ in range(count):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=count, listen=False))
    worker.controls.read_if_due(worker.db)  # as its turns do first
    jobs = Job.objects.claim(["default"], worker=worker.id, limit=count)
    worker.take(jobs, count)
    return worker, jobs


# ---- the lease keeper cannot renew -------------------------------------------------------------


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


# ---- the loop in an outage ---------------------------------------------------------------------


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

    monkeypatch.setattr(worker, "_turn", refused)
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
        worker._check_limits()
        raise OperationalError("connection refused")

    monkeypatch.setattr(worker, "_turn", unreachable)
    monkeypatch.setattr(policy, "outage_pause", lambda failures: 30.0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    time.sleep(0.5)  # in its pause
    gone.set()
    thread.join(5)
    assert not thread.is_alive()
    assert worker._stopping


@pytest.mark.django_db(transaction=True)
def test_a_child_that_cannot_be_started_is_a_crash_not_the_supervisors_end(monkeypatch, caplog):
    # Popen's error (the interpreter gone in a deploy, no process left to fork) ended the
    # supervisor with a traceback, its other children left running unsupervised.
    from django_pgjobs.runtime import processes

    monkeypatch.setattr(processes.sys, "executable", "/nonexistent/python3")
    monkeypatch.setattr(processes.policy, "doubling", lambda *args: 0.01)  # restart at once
    assert processes.Supervisor(2, []).run() == 1  # gave up, as for children that keep dying
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("could not be started" in line and "starting another in" in line for line in said)
    assert "stopping them all" in said[-1]


@pytest.mark.django_db(transaction=True)
def test_a_recycled_worker_lets_its_running_jobs_finish_past_its_grace():
    # A recycle released the running jobs after the grace, without spending an attempt: the
    # next worker started the job again, and again at each recycle (a job whose memory made
    # its worker pass --max-memory-per-child ran for ever, never finishing).
    long = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 1.5}, priority=10)
    for _ in range(6):
        Job.objects.enqueue("tests.tasks.noop")
    options = Options(
        queues=["default"], concurrency=2, listen=False, once=True, max_jobs=3, grace=0.1
    )
    assert Worker(options).run() == Exit.RECYCLE
    rows = dict(Job.objects.values_list("pk", "status"))
    assert rows.pop(long.pk) == Status.SUCCEEDED
    assert Status.RUNNING not in rows.values()
    assert Job.objects.get(pk=long.pk).attempts == 1


@pytest.mark.django_db(transaction=True)
def test_a_recycle_waits_for_a_job_that_never_ends_only_so_long(monkeypatch, caplog):
    # Waiting for every running job to end, a recycle held the whole worker up for good behind
    # one that never returned (no time limit): no claims, no exit, its supervisor none the wiser.
    from django_pgjobs.runtime import lifecycle as stopping

    monkeypatch.setattr(stopping, "RECYCLE_PATIENCE", 1.0)
    monkeypatch.setattr(stopping, "RECYCLE_NOTE_EVERY", 0.3)
    never = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4}, priority=10)
    for _ in range(4):
        Job.objects.enqueue("tests.tasks.noop")
    options = Options(
        queues=["default"], concurrency=2, listen=False, once=True, max_jobs=2, grace=0.1
    )
    began = time.monotonic()
    assert Worker(options).run() == Exit.RECYCLE
    assert time.monotonic() - began < 3.5  # before the job would have ended
    row = Job.objects.get(pk=never.pk)
    assert (row.status, row.attempts) == (Status.READY, 0)  # released: no attempt spent
    assert "waits for 1 running jobs before it is replaced" in caplog.text
    # The released job's handler runs on, with its connection, until it returns.
    wait_until(
        lambda: not any(t.name.startswith("pgjobs-handler") for t in threading.enumerate()), 10
    )


@pytest.mark.django_db(transaction=True)
def test_a_stop_signal_during_a_recycle_gives_the_usual_grace():
    long = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4})
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, grace=0.5))
    ended: list[Exit] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    try:
        wait_until(lambda: Job.objects.filter(status=Status.RUNNING).exists(), 10)
        worker._recycle("a test")
        time.sleep(1.0)  # past the grace: a recycle waits for the job
        assert thread.is_alive()
        worker.stop()  # SIGTERM: the grace, then released
        thread.join(5)
        assert not thread.is_alive()
    finally:
        worker.stop(immediately=True)
        thread.join(10)
    assert Job.objects.values_list("status", flat=True).get(pk=long.pk) == Status.READY
    assert ended == [Exit.OK]  # stopped, not recycled
    # The released job's handler runs on, with its connection, until it returns.
    wait_until(
        lambda: not any(t.name.startswith("pgjobs-handler") for t in threading.enumerate()), 10
    )


@pytest.mark.django_db(transaction=True)
def test_a_memory_limit_below_a_fresh_workers_size_runs_jobs_and_says_so(caplog):
    # Recycled before its first claim, every replacement exited at once: a supervisor
    # restarted children for ever at full CPU and ran none of the jobs, saying nothing.
    for _ in range(3):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(
        Options(queues=["default"], concurrency=1, listen=False, once=True, max_memory_mb=1)
    )
    assert worker.run() == Exit.RECYCLE  # once it has recorded an outcome
    assert Job.objects.filter(status=Status.SUCCEEDED).count() >= 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("before its first job ended, over --max-memory-per-child 1" in s for s in said) == 1


@pytest.mark.django_db(transaction=True)
def test_a_memory_limit_is_looked_at_after_each_turn_that_recorded_outcomes():
    # Looked at once a second, fast jobs grew a worker to 660 MB against a 400 MB limit.
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 500)
    options = Options(queues=["default"], concurrency=2, batch_size=20, listen=False)
    options.max_memory_mb = 1
    assert Worker(options).run() == Exit.RECYCLE
    # The first turn that recorded outcomes (its first two) recycled it: it ran what that
    # turn's statement claimed too, and no more.
    assert Job.objects.filter(status=Status.SUCCEEDED).count() <= 2 + 20


@pytest.mark.django_db(transaction=True)
def test_a_locked_row_holds_back_its_outcome_alone_under_a_shorter_statement_timeout(
    other_connection,
):
    # A project's statement_timeout below the worker's lock_timeout (5 s) cancels the turn's
    # statement first: it was taken for the network ("cannot reach the database") and the whole
    # worker stalled while the row stayed locked, no outcome recorded, no claim made.
    worker, (locked, free) = running(2)
    for job in (locked, free):
        worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '500ms'")
    try:
        with other_connection.transaction():
            other_connection.execute("SELECT FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
            worker.settle_and_claim()
            statuses = dict(Job.objects.values_list("pk", "status"))
            assert (statuses[locked.pk], statuses[free.pk]) == (Status.RUNNING, Status.SUCCEEDED)
    finally:
        connection.close()


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


@pytest.mark.django_db(transaction=True)
def test_jobs_claimed_for_threads_held_up_by_a_slow_job_go_back_for_other_workers():
    # A worker that had seen fast handlers claimed jobs beyond its threads (the prefetch); one
    # slow job then held them, unstarted and their leases renewed, while other workers idled:
    # for as long as it ran, and for good behind a handler that never returns.
    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 5.0}, priority=10)
    quick = {Job.objects.enqueue("tests.tasks.noop").pk for _ in range(20)}
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.2))
    worker.learn_durations([0.001] * 10)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(pk=slow.pk).status == Status.RUNNING, timeout=10)
        taken = wait_until(
            lambda: Job.objects.claim(["default"], worker="other", limit=50), timeout=4
        )
    finally:
        worker.stop(immediately=True)
        thread.join(15)
    assert {job.pk for job in taken} <= quick
    assert {job.attempts for job in taken} == {1}  # given back without spending an attempt


@pytest.mark.django_db(transaction=True)
def test_an_outcome_not_recorded_because_the_claim_was_lost_is_logged_with_its_job(caplog):
    # A worker stopped past its lease (SIGSTOP, a frozen VM) said only "lost=4" in its next
    # activity line: nothing named the jobs whose outcomes it could not record.
    worker, (job,) = running(1)
    Job.objects.filter(pk=job.pk).update(worker="another", claims=F("claims") + 1)  # reaped, taken
    worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    worker.settle_and_claim()
    [line] = [r for r in caplog.records if "was not recorded" in r.getMessage()]
    assert line.levelname == "WARNING"
    assert f"job {job.pk} (tests.tasks.noop): its outcome (succeeded)" in line.getMessage()


def test_a_transaction_the_database_rolled_back_is_not_said_to_be_an_unreachable_database():
    import psycopg

    from django_pgjobs.runtime.reporting import Outage

    error = OperationalError("could not serialize access due to concurrent update")
    error.__cause__ = psycopg.errors.SerializationFailure("could not serialize access")
    assert Outage().describe(error) == (
        "the database rolled a transaction back (could not serialize access due to concurrent "
        "update)"
    )


# ---- what a handler can leave on its job, and logging that raises --------------------------------


def _deeply_nested() -> list[object]:
    top: list[object] = []
    inner = top
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    return top


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "report",
    [
        {"done": 1, "total": 2, "note": "a\x00b"},  # json.dumps takes it, jsonb does not
        {"done": 1, "total": 2, "note": "\ud800"},
        {"done": 1, "total": 2, "note": _deeply_nested()},  # RecursionError
        {"done": float("nan")},
        {"done": 1, "total": 2, "note": "x" * 100_000},
    ],
    ids=["NUL", "lone surrogate", "deep", "NaN", "huge"],
)
def test_a_progress_report_set_by_hand_that_jsonb_refuses_costs_no_outcome(report):
    # Set by hand on current_job().progress, it went into the turn's batch and every fallback:
    # the worker retried the batch as an outage for good (NUL) or dropped its outcomes and
    # claimed nothing more (deep nesting), and the heartbeats carrying it failed too.
    worker, (poisoned, other) = running(2)
    poisoned.progress = report
    assert worker.source.leases.renew([poisoned, other]) == {poisoned.pk, other.pk}
    for job in (poisoned, other):
        worker.hand_in(job, Handled(Verdict.SUCCEEDED))
    worker.settle_and_claim()
    assert set(Job.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}
    assert not worker.claims


class Discarding(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        pass


@pytest.fixture(params=["RequestUser", "Exits"])
def every_line_raises(request):
    """An application's logging filter that raises on every worker line (tests.logfilters), on a
    handler that sees all of them."""
    from tests import logfilters

    handler = Discarding()  # not logging.NullHandler, whose handle() looks at no filter
    handler.addFilter(getattr(logfilters, request.param)())
    pgjobs = logging.getLogger("django_pgjobs")
    level = pgjobs.level
    pgjobs.addHandler(handler)
    pgjobs.setLevel(logging.DEBUG)
    yield
    pgjobs.removeHandler(handler)
    pgjobs.setLevel(level)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("every_line_raises")
def test_a_logging_filter_that_raises_on_every_line_stops_nothing_a_worker_does():
    # The line saying the worker stops to be replaced raised after its turn had committed: it
    # never recycled, and the jobs that turn claimed were never run (reaped later, an attempt
    # spent on nothing).
    for _ in range(8):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True, max_jobs=3))
    assert worker.run() == Exit.RECYCLE
    rows = list(Job.objects.values_list("status", "attempts"))
    assert Status.RUNNING not in {status for status, _ in rows}
    assert {attempts for status, attempts in rows if status == Status.READY} <= {0}
    assert sum(1 for status, _ in rows if status == Status.SUCCEEDED) >= 3


@pytest.mark.django_db(transaction=True)
def test_outcomes_a_turn_recorded_are_accounted_for_when_its_claims_cannot_be_read():
    # A Job model signal's receiver raised while the turn's claimed rows became Job objects:
    # the claims were given back, but the outcomes the same statement had recorded were never
    # accounted for: their slots stayed taken for good and the lease keeper called them lost.
    from django.db.models.signals import post_init

    worker, (done,) = running(1)
    waiting = Job.objects.enqueue("tests.tasks.noop")
    worker.hand_in(done, Handled(Verdict.SUCCEEDED))

    def broken(sender: object, **kwargs: object) -> None:
        raise RuntimeError("post_init receiver bug")

    post_init.connect(broken, sender=Job)
    try:
        with pytest.raises(RuntimeError, match="post_init receiver bug"):
            worker.settle_and_claim()
    finally:
        post_init.disconnect(broken, sender=Job)
    assert not worker.claims and worker._recorded == 1
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert (statuses[done.pk], statuses[waiting.pk]) == (Status.SUCCEEDED, Status.READY)


@pytest.mark.django_db(transaction=True)
def test_a_handler_changing_its_jobs_id_changes_nothing_its_worker_renews_or_records():
    # job.id = str(job.id) (for a JSON body, say): the lease keeper compared the ids it renewed
    # with job.pk, called the claim lost after two rounds and stopped renewing it.
    worker, (job,) = running(1)
    job.id = str(job.id)
    for _ in range(3):
        worker.source.leases.keep_up(worker.claims.all(), heartbeat=True)
    assert not worker.source.leases._lost
    worker.hand_in(job, Handled(Verdict.SUCCEEDED, result_json="1"))
    worker.settle_and_claim()
    assert Job.objects.values_list("status", flat=True).get() == Status.SUCCEEDED
    assert not worker.claims


@pytest.mark.django_db(transaction=True)
def test_the_workers_connections_commit_each_statement_whatever_the_settings_became():
    # A handler set DATABASES["default"]["AUTOCOMMIT"] = False "for its job": the dict is every
    # thread's, and after a reconnect the worker's own statements ran in one transaction never
    # committed, claims and outcomes rolled back at its stop.
    from django_pgjobs.runtime.sessions import LockWaits

    sessions = LockWaits("default")
    connection.close()
    connection.settings_dict["AUTOCOMMIT"] = False
    try:
        sessions.limit_this_thread()
        connection.ensure_connection()
        assert connection.get_autocommit()
    finally:
        connection.settings_dict["AUTOCOMMIT"] = True
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_handler_saving_its_job_may_save_its_own_fields_not_its_workers():
    # current_job().save() wrote the claim-time lease (run out, perhaps), status and claim count
    # over the row: after a lost lease, over another worker's claim.
    worker, (job,) = running(1)
    job.payload = {"cursor": 7}
    job.save(update_fields=["payload"])  # a checkpoint: the handler's own field
    with pytest.raises(ValueError, match="save only the fields you changed"):
        job.save()
    with pytest.raises(ValueError, match="alone writes leased_until"):
        job.save(update_fields=["payload", "leased_until"])
    row = Job.objects.get(pk=job.pk)
    assert (row.payload, row.status, row.worker) == ({"cursor": 7}, Status.RUNNING, worker.id)
    Job.objects.get(pk=job.pk).save(update_fields=["priority"])  # one the worker does not hold


@pytest.mark.django_db(transaction=True)
def test_saving_a_stored_job_whole_is_refused_and_by_its_fields_rewinds_nothing():
    # `job.priority = 5; job.save()` on the Job enqueue returned, after a worker ran it: the
    # row was ready again with claims back at 0, and the job ran a second time.
    job = Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, once=True))
    worker.run()
    job.priority = 5
    with pytest.raises(ValueError, match=r"job .* is stored: save only the fields you changed"):
        job.save()
    job.save(update_fields=["priority"])
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.claims, row.attempts, row.priority) == (Status.SUCCEEDED, 1, 1, 5)
    new = Job(task="tests.tasks.noop", queue="default", max_attempts=1)
    new.save()  # a new row saves whole, as any model's
    assert Job.objects.filter(pk=new.pk).exists()
    partial = Job.objects.only("priority").get(pk=job.pk)
    partial.priority = 7
    partial.save()  # Django saves the fields it loaded: none of the worker's
    assert Job.objects.values_list("priority", "status").get(pk=job.pk) == (7, Status.SUCCEEDED)
    with pytest.raises(ValueError, match="is stored"):
        Job.objects.only("priority", "status").get(pk=job.pk).save()
    copy = Job.objects.get(pk=job.pk)
    copy.pk = None
    copy.save()  # Django's way of copying a row: a new one
    assert Job.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_job_cancelled_while_it_waits_for_a_thread_is_not_started():
    # Claimed and waiting behind a slow job (prefetch, a turn's batch), it showed as running: the
    # operator's cancel was told "running ones stop if their handler checks", and the handler,
    # started after the cancel had committed, ran in full.
    from tests.models import Execution

    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 0.8}, priority=10)
    waiting = Job.objects.enqueue("tests.tasks.record", {"n": 2})
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    worker.learn_durations([0.001] * 10)  # fast handlers so far: it claims beyond its thread
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=10)
        assert Job.objects.get(pk=waiting.pk).status == Status.RUNNING  # claimed, not started
        assert Job.objects.filter(pk=waiting.pk).cancel() == [waiting.pk]
        wait_until(lambda: Job.objects.get(pk=waiting.pk).status == Status.CANCELLED, timeout=10)
    finally:
        worker.stop()
        thread.join(15)
    assert not Execution.objects.filter(n=2).exists()
    assert Job.objects.get(pk=slow.pk).status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_past_its_time_limit_is_cancelled_and_its_thread_ends():
    # A thread cannot be stopped, a coroutine can: its attempt recorded as timed out, the
    # coroutine awaited on for its whole minute, and its abandoned handler thread with it.
    from tests import hostile

    hostile.async_time_limit_seen.clear()
    job = Job.objects.enqueue("tests.hostile.awaits_past_its_time_limit")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.FAILED, 10)
        wait_until(lambda: hostile.async_time_limit_seen == ["cancelled"], 5)
        wait_until(lambda: worker.handlers.deadlines.abandoned_alive() == 0, 5)
    finally:
        worker.stop()
        thread.join(10)
    assert Job.objects.get(pk=job.pk).errors[-1]["type"].endswith("JobTimeout")


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_cancelled_inside_a_sync_call_is_said_to_be_so(caplog):
    # The line said the handler "returned, leaving tasks" and that the outcome was the
    # handler's; it was cancelled, the call runs on, and the outcome is the time limit's.
    job = Job.objects.enqueue("tests.hostile.awaits_a_slow_sync_call_past_its_time_limit")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: "was cancelled at its time limit" in caplog.text, 15)
    finally:
        worker.stop()
        thread.join(10)
    assert str(job.pk) in caplog.text and "returned, leaving tasks" not in caplog.text
    assert Job.objects.get(pk=job.pk).errors[-1]["type"].endswith("JobTimeout")
