"""The session settings of the worker's own connections (runtime/sessions.py)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from django_pgjobs.data import rows
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.observability import stats
from django_pgjobs.outcomes import Outcome
from django_pgjobs.runtime import postgres
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.sessions import (
    IDLE_IN_TRANSACTION,
    LOCK_TIMEOUT,
    LockWaits,
    application_name,
)
from django_pgjobs.runtime.worker import Worker
from tests.conftest import end_sessions_of, wait_until
from tests.plans import planned_once_on_an_empty_table, sequential_scans


def _settings() -> tuple[str, str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('application_name'), "
            "current_setting('synchronous_commit')"
        )
        return cursor.fetchone()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("durable", "expected"), [(False, "off"), (True, "on")])
def test_the_workers_connections_are_named_and_commit_as_the_setting_says(
    settings, durable, expected
):
    settings.PGJOBS = {"WORKER_SYNCHRONOUS_COMMIT": durable}
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        assert _settings() == (LOCK_TIMEOUT, "pgjobs worker host:1:ab", expected)
        connection.close()  # and again after a reconnect
        assert _settings() == (LOCK_TIMEOUT, "pgjobs worker host:1:ab", expected)
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_workers_own_transactions_end_with_their_session_if_left_idle():
    # A worker stopped inside its transaction (SIGSTOP, a frozen VM, a partition) would hold its
    # locks (a limited queue's row) until TCP gave up on the connection; the server now ends
    # the session after IDLE_IN_TRANSACTION instead.
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('idle_in_transaction_session_timeout')")
            assert cursor.fetchone() == (IDLE_IN_TRANSACTION,)
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_other_threads_connections_keep_their_own_settings():
    sessions = LockWaits("default", application_name("host:1:ab"))
    seen = []
    try:
        sessions.limit_this_thread()

        def handler() -> None:
            seen.append(_settings())
            connection.close()

        thread = threading.Thread(target=handler)
        thread.start()
        thread.join()
    finally:
        sessions.stop()
        connection.close()
    assert seen[0][1:] == ("", "on")


@pytest.fixture
def one_connection_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Django's connection pool (DATABASES OPTIONS "pool") of one connection, for this test."""
    pool = {"min_size": 1, "max_size": 1, "timeout": 2}
    shared = connection.settings_dict  # every thread's; the worker's own get copies
    options = {**shared.get("OPTIONS", {}), "pool": pool}
    connection.close()
    monkeypatch.setitem(shared, "OPTIONS", options)
    monkeypatch.setitem(shared, "CONN_MAX_AGE", 0)
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict = shared
        connection.close_pool()


def _in_a_thread(work: Callable[[], Any]) -> Any:
    """What `work` returns (or raises) on a thread of its own, its connections closed after."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(work())
        except Exception as error:
            done.append(error)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if isinstance(done[0], Exception):
        raise done[0]
    return done[0]


@pytest.mark.django_db(transaction=True)
def test_with_djangos_connection_pool_the_worker_keeps_its_connections_outside_it(
    one_connection_pool: None,
) -> None:
    # Before: the worker's own threads took theirs from the pool and held them, so a handler
    # waited for a connection (here: failed after the pool's 2 s); and one handed back after an
    # error went to the next handler with the worker's session settings (synchronous_commit
    # off, a lock_timeout, an idle-in-transaction timeout, the worker's application_name).
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        assert _settings()[1:] == ("pgjobs worker host:1:ab", "off")  # its own, held
        assert connection.pool is None
        assert _in_a_thread(_settings)[1:] == ("", "on")  # a handler: the pool's connection
        connection.close()  # after an error, say
        assert _in_a_thread(_settings) == ("0", "", "on")
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_with_djangos_connection_pool_the_listener_keeps_its_connection_outside_it(
    one_connection_pool: None,
) -> None:
    # Before: it took the pool's connection (the handlers waited for it, then failed), and each
    # of its reconnections closed one without handing it back: after a few, the pool had
    # none left, and the worker ran nothing until restarted (attack 14).
    connects: list[float] = []
    stopped = threading.Event()
    thread = threading.Thread(
        target=postgres.listen,
        args=("default", lambda queue: None, lambda: connects.append(1), stopped.is_set),
        daemon=True,
    )
    thread.start()
    try:
        wait_until(lambda: connects, timeout=10)
        assert _in_a_thread(_settings)[1:] == ("", "on")  # a handler: the pool's connection
    finally:
        stopped.set()
        thread.join(10)


@pytest.mark.django_db(transaction=True)
def test_the_workers_transactions_are_read_committed_whatever_isolation_the_project_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: under OPTIONS isolation_level SERIALIZABLE (or REPEATABLE READ), a limited
    # queue's claim (several statements in one transaction) took its snapshot before another
    # worker's claim committed, and failed as a serialization failure: an outage each time.
    options = {**connection.settings_dict.get("OPTIONS", {})}
    options["isolation_level"] = psycopg.IsolationLevel.SERIALIZABLE
    connection.close()
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)

    def isolation() -> str:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return cursor.fetchone()[0]

    sessions = LockWaits("default")
    try:
        sessions.limit_this_thread()
        assert isolation() == "read committed"
        assert _in_a_thread(isolation) == "serializable"  # a handler's: the project's
        connection.close()
        assert isolation() == "read committed"  # connected again
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_an_application_name_the_project_configured_is_kept():
    """DATABASES OPTIONS naming the connections is the project's choice (its monitoring, or the
    chaos suite's audit trigger, may read it): the worker keeps it, and sets the rest."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    options["application_name"] = "shop worker 7"
    connection.close()
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        assert _settings() == (LOCK_TIMEOUT, "shop worker 7", "off")
    finally:
        sessions.stop()
        del options["application_name"]
        connection.close()


def _prepared() -> list[tuple[str, int, int]]:
    """The statements this session has prepared (its own; another session's are not visible),
    with how many times each was run with its generic plan and with a custom one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        return cursor.fetchall()


def _planning() -> tuple[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode'), current_setting('jit')")
        return cursor.fetchone()


def _claim_six_times() -> None:
    for _ in range(6):  # past the threshold: psycopg prepares at the fifth execution
        Job.objects.enqueue("tests.tasks.noop")
        assert Job.objects.claim(["default"], worker="w", limit=1)


@pytest.mark.django_db(transaction=True)
def test_the_workers_connections_prepare_what_they_run_again_and_again_and_plan_it_once(
    monkeypatch,
):
    monkeypatch.setattr(rows, "REPLAN_AFTER", 3600.0)  # the same plan throughout
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        assert _planning() == ("force_generic_plan", "off")
        _claim_six_times()
        (turn,) = [p for p in _prepared() if p[0].lstrip().startswith("WITH due AS")]
        generic, custom = turn[1:]
        assert generic >= 1 and custom == 0  # prepared after five claims, planned for any values
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "setting",
    [
        {"OPTIONS": {"prepare_threshold": None}},  # the project turned preparing off
        {"DISABLE_SERVER_SIDE_CURSORS": True},  # a transaction-mode pooler
    ],
)
def test_a_project_that_turned_preparing_off_or_uses_a_pooler_gets_no_prepared_statements(
    setting,
):
    saved = copy.deepcopy(connection.settings_dict)
    for key, value in setting.items():
        if isinstance(value, dict):
            connection.settings_dict.setdefault(key, {}).update(value)
        else:
            connection.settings_dict[key] = value
    connection.close()
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        _claim_six_times()
        assert _prepared() == []
        assert _planning()[0] == "auto"
    finally:
        sessions.stop()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_worker_keeps_working_when_a_migration_changes_a_column_its_prepared_turn_returns(
    other_connection, signal_handlers_restored, caplog
):
    """A migration run while workers run may change a column's type: PostgreSQL then refuses
    the prepared statement ("cached plan must not change result type") from then on. The worker
    treats it like a lost connection: it reconnects (which prepares afresh) and goes on."""
    worker = Worker(Options(queues=["default"], concurrency=4, listen=False, poll_interval=0.05))
    turns: list[float] = []
    turn = worker.settle_and_claim

    def counted() -> None:
        turns.append(time.monotonic())
        turn()

    worker.settle_and_claim = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 200)
        wait_until(lambda: worker._recorded == 200, 20)
        # Idle turns, however slow a loaded machine makes them: their claims are prepared. An
        # idle claim comes in two shapes (a sweep from the queue's start, or one after the
        # worker's position: their parameters' types differ), each prepared after five runs of
        # its own, so thirty turns; and the column stays changed until the worker met it (the
        # 20 jobs may all be claimed by the shape not prepared yet, which meets nothing).
        drained = len(turns)
        wait_until(lambda: len(turns) >= drained + 30, 30)
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN task TYPE text")
        try:
            Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 20)
            wait_until(
                lambda: (
                    any("a migration changed the job table" in line for line in _said(caplog))
                    and Job.objects.filter(status="succeeded").count() == 220
                ),
                20,
            )
        finally:
            other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN task TYPE varchar(200)")
    finally:
        worker.stop()
        thread.join(20)
    assert not any("refused" in line for line in _said(caplog)), _said(caplog)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


@pytest.mark.django_db(transaction=True)
def test_a_prepared_statement_that_no_longer_fits_the_table_is_the_connections_fault(
    other_connection,
):
    """So outcomes that a turn was recording when it met a migration are tried again on a new
    connection (runtime/postgres.py), never taken for a refusal of the batch, which records
    them one by one and dead-letters those refused again."""
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        _claim_six_times()  # prepared
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN task TYPE text")
        with pytest.raises(DatabaseError) as refused:
            Job.objects.claim(["default"], worker="w", limit=1)
        assert "cached plan must not change result type" in str(refused.value)
        assert rows.connection_lost(refused.value)
    finally:
        sessions.stop()
        connection.close()
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN task TYPE varchar(200)")


@pytest.mark.django_db(transaction=True)
def test_plans_made_while_the_table_was_empty_are_made_again_once_it_holds_a_backlog(
    monkeypatch, other_connection
):
    """A worker started on an empty table plans its turn for an empty table: read it whole,
    which costs least then. PostgreSQL keeps a cached plan until autovacuum analyzes the table
    (off here, as it is for the seconds a backlog takes to arrive); `replan` has the next
    statements planned for the table as it is by then."""
    # Long enough that the first turns and the insert stay within it on a loaded machine.
    monkeypatch.setattr(rows, "REPLAN_AFTER", 2.0)
    with planned_once_on_an_empty_table(other_connection):

        def turns() -> None:
            for _ in range(8):  # past the threshold: prepared, its plan cached
                Job.objects.claim(["default"], worker="w", limit=1)

        turns()  # planned for the empty table
        other_connection.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts) "
            "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3 "
            "FROM generate_series(1, 20000)"
        )
        before = sequential_scans(other_connection)
        rows.replan("default", backlog=True)  # too soon: the plans are younger than REPLAN_AFTER
        turns()
        stale = sequential_scans(other_connection) - before
        time.sleep(2.0)
        before = sequential_scans(other_connection)
        rows.replan("default", backlog=True)
        turns()
        assert (stale, sequential_scans(other_connection) - before) == (stale, 0)
        assert stale >= 8  # the empty table's plan read the backlog whole at every turn


@pytest.mark.django_db(transaction=True)
def test_a_worker_asks_for_new_plans_when_a_turn_comes_back_full(
    monkeypatch, signal_handlers_restored
):
    asked: list[str] = []

    def replan(db: str, backlog: bool) -> None:
        if backlog:
            asked.append(db)

    monkeypatch.setattr(rows, "replan", replan)
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, poll_interval=0.05))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        time.sleep(0.3)  # idle: its turns come back empty
        assert asked == []
        Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 500)
        wait_until(lambda: worker._recorded == 500, 30)
    finally:
        worker.stop()
        thread.join(30)
    assert asked and set(asked) == {"default"}


@pytest.mark.django_db(transaction=True)
def test_a_workers_connections_keep_tcp_alive_keeping_the_projects_own_settings():
    """A database gone from the network without closing the connections is noticed in about
    20 s (sessions.KEEPALIVES), not the kernel's two hours; what the project set stays."""
    settings_dict = connection.settings_dict
    saved = copy.deepcopy(settings_dict.get("OPTIONS", {}))
    settings_dict.setdefault("OPTIONS", {})["keepalives_idle"] = 99  # the project's own
    try:
        Worker(Options(queues=["default"], once=True, listen=False, concurrency=1)).run()
        connection.ensure_connection()  # as the worker's threads connect
        parameters = connection.connection.info.get_parameters()
    finally:
        settings_dict["OPTIONS"] = saved
        connection.close()
    assert parameters["keepalives"] == "1"
    assert parameters["keepalives_idle"] == "99"
    assert (parameters["keepalives_interval"], parameters["keepalives_count"]) == ("5", "3")
    assert parameters["tcp_user_timeout"] == "20000"


@pytest.mark.django_db(transaction=True)
def test_a_supervisors_connection_keeps_tcp_alive_too():
    """Its statement taking back a dead child's jobs must not wait the kernel's two hours on a
    database gone from the network."""
    from django_pgjobs.runtime.processes import Supervisor

    settings_dict = connection.settings_dict
    saved = copy.deepcopy(settings_dict.get("OPTIONS", {}))
    try:
        assert Supervisor(0, []).run() == 0  # no child to run: it ends at once
        connection.ensure_connection()
        parameters = connection.connection.info.get_parameters()
    finally:
        settings_dict["OPTIONS"] = saved
        connection.close()
    assert (parameters["keepalives"], parameters["tcp_user_timeout"]) == ("1", "20000")


class EndedBeforeItsLastReport(Worker):
    """A worker whose session the server ends just before its last report (a failover, a
    session terminated as the worker stops), `times` times."""

    times = 1

    def _report(self, seconds: float, stopping: bool = False) -> None:
        if stopping and self.times:
            self.times -= 1
            connection.ensure_connection()  # this thread's, named after the worker
            assert end_sessions_of(self.id)
        super()._report(seconds, stopping)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("times", [1, 2])
def test_a_worker_whose_session_ended_before_its_last_report_still_records_that_it_stopped(
    caplog, times
):
    # Its last report, the first statement on a connection the server had ended, failed with
    # only the activity logged (silently in the NATS worker): the stopped worker read as alive,
    # then as one gone silent. Now its connection is made again, once; failing again, it says so.
    worker = EndedBeforeItsLastReport(Options(queues=["default"], listen=False, stats_interval=0.5))
    worker.times = times
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_until(lambda: QueueStat.objects.filter(worker=worker.id).exists(), timeout=20)
    worker.stop()
    thread.join(20)
    assert not thread.is_alive() and worker.times == 0
    (seen,) = [w for w in stats.worker_stats() if w.worker == worker.id]
    assert seen.stopped == (times == 1)
    said = f"worker {worker.id} could not record that it stopped (OperationalError: terminating"
    assert (said in caplog.text) == (times == 2)


@pytest.mark.django_db(transaction=True)
def test_what_a_report_could_not_write_is_written_by_the_next(other_connection):
    # A report that failed (its connection gone) lost what it counted: the jobs done in that
    # interval were missing from every throughput and retry rate.
    worker = Worker(Options(queues=["default"], listen=False))
    job = Job(queue="default", task="tests.tasks.record", attempts=1)
    worker.activity.finished(job, Outcome.SUCCEEDED, 0.01)
    QueueStat.objects.count()  # a connection, which the server then ends
    other_connection.execute(
        "SELECT pg_terminate_backend(%s, 10000)", [connection.connection.info.backend_pid]
    )
    with pytest.raises(DatabaseError):
        worker._report(1.0)
    connection.close()  # as the worker does after its connection's fault
    worker._report(2.0)
    assert list(QueueStat.objects.values_list("seconds", "succeeded")) == [(2.0, 1)]


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
