"""A worker's main loop prepares its statements and plans them once (runtime/sessions.py,
data/rows.py): what an operator, a migration or a lost connection does to those plans must cost
no job its outcome."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
from django.db import DatabaseError, OperationalError, connection

from django_pgjobs.data import rows
from django_pgjobs.models import Job, Queue
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.sessions import LockWaits, application_name
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.plans import planned_once_on_an_empty_table, sequential_scans


def _prepared() -> list[str]:
    """The statements this session has prepared."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [statement for (statement,) in cursor.fetchall()]


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _gone(other: Any, pid: int) -> bool:
    query = "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)"
    return bool(other.execute(query, [pid]).fetchone()[0])


def _plan_cache_mode() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_outcomes_in_the_turn_that_meets_a_migrated_column_are_recorded_not_dead_lettered(
    other_connection,
):
    """The turn that meets "cached plan must not change result type" may carry outcomes. The
    database refused none of them, only the plan made before the migration: they are recorded
    once the worker has reconnected (as for a lost connection), never taken for a refused
    batch, which records them one by one with the same stale plan and dead-letters them."""
    worker = Worker(Options(queues=["default"], concurrency=1, batch_size=1, listen=False))
    worker.source.lock_waits.limit_this_thread(plans=True)  # this thread runs the worker's turns
    try:
        for _ in range(12):
            Job.objects.enqueue("tests.tasks.noop")
        jobs = Job.objects.claim(["default"], worker=worker.id, limit=12)
        worker.take(jobs, 12)
        # Turns that only record (every slot is taken): their statement is prepared.
        for job in jobs[:8]:
            worker.hand_in(job, Handled(Verdict.SUCCEEDED))
            worker.settle_and_claim()
        assert any("/* plans 0 */" in statement for statement in _prepared())
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE int4")
        try:
            worker.hand_in(jobs[8], Handled(Verdict.SUCCEEDED))
            try:
                worker.settle_and_claim()
            except DatabaseError:  # what the worker's loop does: a new connection, a new turn
                connection.close()
                worker.settle_and_claim()
        finally:
            other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE int2")
    finally:
        worker.source.lock_waits.stop()
        connection.close()
    ninth = Job.objects.get(pk=jobs[8].pk)
    assert (ninth.status, ninth.last_error) == (Status.SUCCEEDED, "")


@pytest.mark.django_db(transaction=True)
def test_a_connection_terminated_under_the_worker_is_prepared_and_planned_once_again(
    other_connection,
):
    """pg_terminate_backend on the main loop's connection, three times: each new connection
    gets the session settings and prepares again, and the dead ones are not kept."""
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        for _ in range(3):
            for _ in range(6):  # past psycopg's threshold
                Job.objects.claim(["default"], worker="w", limit=1)
            assert _plan_cache_mode() == "force_generic_plan"
            assert any(s.lstrip().startswith("WITH due AS") for s in _prepared())
            pid = _backend_pid()
            other_connection.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_until(lambda pid=pid: _gone(other_connection, pid), 10)
            with pytest.raises(OperationalError):
                Job.objects.claim(["default"], worker="w", limit=1)
            connection.close()  # as the worker's loop does
        Job.objects.claim(["default"], worker="w", limit=1)
        gc.collect()
        assert list(rows._PLANNED_ONCE.keys()) == [connection.connection]
    finally:
        sessions.stop()
        connection.close()


OPERATIONS = [
    "ANALYZE pgjobs_job",
    "VACUUM pgjobs_job",
    "VACUUM FULL pgjobs_job",
    "CLUSTER pgjobs_job USING pgjobs_job_pkey",
    "REINDEX TABLE pgjobs_job",
]


@pytest.mark.django_db(transaction=True)
def test_an_operator_rewriting_the_job_table_under_a_running_worker_costs_no_job(
    other_connection, signal_handlers_restored, caplog
):
    """ANALYZE, VACUUM FULL, CLUSTER and REINDEX while the worker runs prepared statements:
    PostgreSQL plans them again by itself (their result types are unchanged), so the worker
    never fails a turn and every job succeeds."""
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, poll_interval=0.05))
    ended: list[object] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    try:
        total = 0
        for operation in OPERATIONS * 2:
            for _ in range(20):
                Job.objects.enqueue("tests.tasks.noop")
            total += 20
            other_connection.execute(operation)
            wait_until(lambda n=total: Job.objects.filter(status="succeeded").count() == n, 20)
    finally:
        worker.stop()
        thread.join(20)
    assert ended
    failures = ("django_pgjobs.runtime.reporting", "django_pgjobs.runtime.settling")
    said = [r.getMessage() for r in caplog.records if r.name in failures]
    assert said == []


def _succeeded() -> int:
    return Job.objects.filter(status=Status.SUCCEEDED).count()


@pytest.mark.django_db(transaction=True)
def test_a_worker_with_a_limited_queue_goes_on_after_its_connections_are_terminated(
    other_connection, signal_handlers_restored, caplog
):
    """A queue with a limit is claimed inside a transaction (LOCK_QUEUE, then the prepared
    claim); its connections terminated mid-run, three times, the worker reconnects, prepares
    again and finishes both queues' jobs, never more than max_running of the limited one."""
    Queue.objects.create(name="limited", max_running=2)
    options = Options(queues=["limited", "open"], concurrency=4, listen=False, poll_interval=0.05)
    worker = Worker(options)
    ended: list[object] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    most = 0

    def running_within_the_limit(total: int) -> bool:
        nonlocal most
        most = max(most, Job.objects.filter(queue="limited", status=Status.RUNNING).count())
        return _succeeded() == total

    try:
        for batch in range(3):
            for n in range(30):
                payload = {"n": batch * 100 + n, "seconds": 0.01}
                Job.objects.enqueue("tests.tasks.record", payload, queue=["limited", "open"][n % 2])
            started = batch * 30 + 5
            wait_until(lambda started=started: _succeeded() >= started, 20)
            other_connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s",
                [application_name(worker.id)],
            )
            wait_until(lambda total=(batch + 1) * 30: running_within_the_limit(total), 30)
    finally:
        worker.stop()
        thread.join(20)
    assert ended
    assert not Job.objects.exclude(status=Status.SUCCEEDED).exists()
    assert most <= 2
    assert any(r.name == "django_pgjobs.runtime.reporting" for r in caplog.records)  # it was cut


@pytest.mark.django_db(transaction=True)
def test_planned_once_claims_across_queues_take_turns_by_priority_and_never_read_the_table_whole(
    monkeypatch, other_connection
):
    """Five queues: one with a backlog of 20,000, one with jobs of a higher priority, one with
    a scheduled job come due (not yet promoted), one with a lower priority, one empty. Planned
    once for any parameters (after the plans made on the empty table were replaced), each
    queue's best job comes in the first turn, and no turn reads the table whole."""
    monkeypatch.setattr(rows, "REPLAN_AFTER", 0.0)
    other_connection.execute("ALTER TABLE pgjobs_job SET (autovacuum_enabled = false)")
    other_connection.execute("VACUUM ANALYZE pgjobs_job")
    queues = ["big", "urgent", "due", "low", "empty"]
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        for _ in range(8):  # prepared, planned for the empty table
            assert Job.objects.claim(queues, worker="w", limit=10) == []
        other_connection.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, priority, run_at,"
            "                        scheduled) "
            "SELECT gen_random_uuid(), q, 'tests.tasks.noop', '{}', 3, p, now() - interval '1s', s "
            "FROM (VALUES ('big', 0, false, 20000), ('urgent', 5, false, 3), "
            "             ('due', 0, true, 1), ('low', -1, false, 2)) AS v(q, p, s, n), "
            "     generate_series(1, n)"
        )
        rows.replan("default", backlog=True)
        before = sequential_scans(other_connection)
        first = Job.objects.claim(queues, worker="w", limit=4)
        turns = [Job.objects.claim(queues, worker="w", limit=10) for _ in range(8)]
        scans = sequential_scans(other_connection) - before
        assert sorted(job.queue for job in first) == ["big", "due", "low", "urgent"]
        assert [len(turn) for turn in turns] == [10] * 8
        assert scans == 0
    finally:
        sessions.stop()
        other_connection.execute("ALTER TABLE pgjobs_job RESET (autovacuum_enabled)")
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_plans_made_on_an_empty_table_are_made_again_for_a_backlog_of_scheduled_jobs(
    monkeypatch, other_connection
):
    """A backlog that is not yet due (a bulk import scheduled for tomorrow) never fills a
    turn: until autovacuum analyzes the table (off here, as it is for the minute it may take),
    the plans made while it was empty read it whole at every idle poll, promotion and reap.
    Idle plans are made again after REPLAN_IDLE (here at once), as the worker's idle turn
    asks."""
    monkeypatch.setattr(rows, "REPLAN_IDLE", 0.0)
    with planned_once_on_an_empty_table(other_connection):

        def idle_turns() -> None:
            for _ in range(8):  # past the threshold: prepared, their plans cached
                Job.objects.claim(["default"], worker="w", limit=10)
                Job.objects.promote()
                Job.objects.reap(sparing=[])

        idle_turns()  # planned for the empty table
        other_connection.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, run_at, scheduled) "
            "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3, "
            "       now() + interval '1 day', true "
            "FROM generate_series(1, 20000)"
        )
        rows.replan("default", backlog=False)  # the worker's next idle turn, REPLAN_IDLE on
        before = sequential_scans(other_connection)
        idle_turns()
        assert sequential_scans(other_connection) - before == 0
