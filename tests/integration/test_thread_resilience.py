"""The worker's long-lived threads (the lease keeper, the wake-up listener, a NATS worker's
acknowledgements) live as long as the worker: a database that keeps refusing is tried again
after a pause, not hundreds of times a second, and a logging filter that raises cannot end
them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import psycopg
import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.runtime import postgres
from django_pgjobs.runtime.leases import LeaseKeeper
from django_pgjobs.runtime.sessions import LockWaits
from tests.conftest import ReadOnlySessions, read_only_sessions, wait_until
from tests.factories import JobFactory
from tests.integration.test_transitions import claim_one
from tests.logfilters import RequestUser

LEASE = 3.0  # a heartbeat every second, retries at most half a second apart


class NeedsARequest(RequestUser):
    """An application's filter that raises AttributeError on a worker's records, counting the
    records it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.calls += 1
        return super().filter(record)


@pytest.fixture
def raising_filter() -> Iterator[NeedsARequest]:
    needs_a_request = NeedsARequest()
    loggers = [
        logging.getLogger(name)
        for name in (
            "django_pgjobs.runtime.leases",
            "django_pgjobs.runtime.postgres",
            "django_pgjobs.jetstream.source",
        )
    ]
    for logger in loggers:
        logger.addFilter(needs_a_request)
    yield needs_a_request
    for logger in loggers:
        logger.removeFilter(needs_a_request)


@pytest.fixture
def read_only() -> Iterator[ReadOnlySessions]:
    """While `refusing`, every session the lease keeper's thread opens is read-only, as those
    of a primary that failed over are: the server refuses its heartbeats. The keeper drops its
    connection after a database error, so its first connection after `refusing` is unset is
    writable again."""
    with read_only_sessions("pgjobs-leases") as receiver:
        receiver.refusing = True
        yield receiver


class Keeper:
    """A lease keeper over one claimed job (its lease set to end now), counting its
    heartbeats."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.attempts: list[float] = []
        jobs = Job.objects.db_manager("default")  # a copy, to count its heartbeats on
        heartbeat = jobs.heartbeat

        def counted(claims: list[Job], lease: float | None = None) -> set[UUID]:
            self.attempts.append(time.monotonic())
            return heartbeat(claims, lease)

        jobs.heartbeat = counted  # type: ignore[method-assign]
        self.jobs = jobs
        self.lock_waits = LockWaits("default")
        self.keeper = LeaseKeeper(jobs, lambda: [job], lambda job: LEASE, LEASE, self.lock_waits)

    def __enter__(self) -> Keeper:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pgjobs_job SET leased_until = statement_timestamp() WHERE id = %s",
                [self.job.pk],
            )
        self.keeper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.keeper.stop()
        self.keeper._thread.join(5)
        self.lock_waits.stop()

    def alive(self) -> bool:
        return self.keeper._thread.is_alive()

    def renewed(self) -> bool:
        """Whether a heartbeat renewed the lease since __enter__: it ends more than two seconds
        from now, on the database's clock."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT leased_until > statement_timestamp() + interval '2 seconds' "
                "FROM pgjobs_job WHERE id = %s",
                [self.job.pk],
            )
            return bool(cursor.fetchone()[0])

    def attempts_in(self, seconds: float) -> int:
        """How many heartbeats were tried in `seconds`, from the first one."""
        wait_until(lambda: self.attempts, timeout=5)
        # Counting over a window of time is the measurement itself, not a wait for a state.
        time.sleep(max(0.0, seconds - (time.monotonic() - self.attempts[0])))
        return sum(1 for at in self.attempts if at - self.attempts[0] <= seconds)


# ---- the lease keeper -----------------------------------------------------------------------


def test_the_pause_after_failed_rounds_doubles_from_half_a_second_to_a_sixth_of_the_lease() -> None:
    keeper = LeaseKeeper(Job.objects, list, lambda job: 30.0, 30.0, LockWaits("default"))
    assert [keeper.retry_pause(failures) for failures in range(1, 7)] == [
        0.5, 1.0, 2.0, 4.0, 5.0, 5.0,
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)  # the keeper's thread has its own connection
def test_a_read_only_database_is_tried_a_few_times_a_second_and_renewed_once_writable(
    read_only: ReadOnlySessions, caplog: Any
) -> None:
    JobFactory()
    with Keeper(claim_one()) as keeper:
        # Without a pause between failed rounds: over a hundred connects in three seconds.
        assert 3 <= keeper.attempts_in(3.0) <= 8
        assert not keeper.renewed()
        read_only.refusing = False
        wait_until(keeper.renewed, timeout=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "django_pgjobs.runtime.leases"]
    # The first failure, with the database's error (then a count every 30 s), and the end.
    assert len(lines) == 2, caplog.text
    assert "could not renew leases: cannot execute UPDATE in a read-only transaction" in lines[0]
    assert "the lease keeper renews leases again" in lines[1]


@pytest.mark.django_db(transaction=True)
def test_a_round_that_raises_every_time_logs_one_traceback_and_renews_once_it_stops(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="django_pgjobs.runtime.leases")
    JobFactory()
    with Keeper(claim_one()) as keeper:
        heartbeat = keeper.jobs.heartbeat

        def broken(claims: list[Job], lease: float | None = None) -> set[UUID]:
            keeper.attempts.append(time.monotonic())
            raise RuntimeError("a bug")

        monkeypatch.setattr(keeper.jobs, "heartbeat", broken)  # before its first round, at 1 s
        assert 3 <= keeper.attempts_in(3.0) <= 8  # without a pause: thousands of tracebacks
        assert not keeper.renewed()
        monkeypatch.setattr(keeper.jobs, "heartbeat", heartbeat)
        wait_until(keeper.renewed, timeout=3)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, caplog.text
    assert "the lease keeper's round failed" in tracebacks[0].getMessage()
    assert "the lease keeper renews leases again" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_logging_filter_that_raises_does_not_end_the_lease_keeper(
    read_only: ReadOnlySessions, raising_filter: NeedsARequest
) -> None:
    """A filter that raises for the keeper's warning would end its thread, and the worker would
    run on with leases nothing renews (reaped by other workers, run twice)."""
    JobFactory()
    with Keeper(claim_one()) as keeper:
        wait_until(lambda: len(keeper.attempts) >= 2, timeout=5)
        assert raising_filter.calls >= 1  # the keeper's warning went through the filter
        assert keeper.alive()
        read_only.refusing = False
        wait_until(keeper.renewed, timeout=3)
        assert keeper.alive()


# ---- the wake-up listener -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_logging_filter_that_raises_does_not_end_the_listener_which_wakes_the_worker_again(
    other_connection: psycopg.Connection[Any], raising_filter: NeedsARequest
) -> None:
    """A listener thread that ended would leave its worker polling, wake-ups lost unnoticed."""
    name = "pgjobs test listener"
    connects: list[float] = []
    wakes: list[str] = []
    stopped = threading.Event()
    thread = threading.Thread(
        target=postgres.listen,
        args=("default", wakes.append, lambda: connects.append(time.monotonic()), stopped.is_set),
        kwargs={"name": name},
        daemon=True,
    )
    thread.start()
    try:
        wait_until(lambda: connects, timeout=5)
        other_connection.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [name],
        )
        wait_until(lambda: len(connects) >= 2, timeout=5)  # connected again after its pause
        assert raising_filter.calls >= 1  # its warning went through the filter
        other_connection.execute("SELECT pg_notify('pgjobs', 'default')")
        wait_until(lambda: "default" in wakes, timeout=5)
        assert thread.is_alive()
    finally:
        stopped.set()
        thread.join(5)


# ---- a NATS worker's acknowledgements -------------------------------------------------------


def test_a_logging_filter_that_raises_does_not_end_a_nats_workers_acknowledgements(
    raising_filter: NeedsARequest,
) -> None:
    """Its thread tells the server every lease/3 that running handlers still run; if it ended,
    their messages would be delivered again while they run."""
    pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")
    from django_pgjobs.jetstream.source import NatsSource

    tries: list[int] = []

    def hold() -> None:  # a round's in-progress acknowledgements
        tries.append(1)
        raise ConnectionError("NATS is gone")

    stopped = threading.Event()
    acks = SimpleNamespace(
        ack_wait=0.15,
        seat=SimpleNamespace(stopping=stopped.is_set),
        _deliveries={1: "a delivery"},
        _consumers=SimpleNamespace(read=lambda last: last),
        _send_in_progress=hold,
        bridge=SimpleNamespace(closed=False),
    )
    thread = threading.Thread(target=NatsSource._keep_in_progress, args=(acks,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(tries) >= 3, timeout=5)
        assert raising_filter.calls >= 1
        assert thread.is_alive()
    finally:
        stopped.set()
        acks._deliveries = {}
        thread.join(5)


@pytest.mark.django_db(transaction=True)
def test_an_idle_session_timeout_of_the_database_does_not_end_the_workers_own_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Managed services set one (PostgreSQL 14+): the listener, idle by design, was ended every
    # period, logging a warning that reads like a crash, a gap in wake-ups each time.
    options = {
        **connection.settings_dict.get("OPTIONS", {}),
        "options": "-c idle_session_timeout=300",
    }
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connects: list[float] = []
    stopped = threading.Event()
    thread = threading.Thread(
        target=postgres.listen,
        args=(
            "default",
            lambda queue: None,
            lambda: connects.append(time.monotonic()),
            stopped.is_set,
        ),
        daemon=True,
    )
    thread.start()
    try:
        wait_until(lambda: connects, timeout=5)
        time.sleep(1.5)  # five of the database's idle timeouts
        assert len(connects) == 1
    finally:
        stopped.set()
        thread.join(5)
    connection.close()  # made again with the option: the main loop's and lease keeper's
    lock_waits = LockWaits("default")
    lock_waits.limit_this_thread()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_session_timeout")
            assert cursor.fetchone()[0] == "0"
    finally:
        lock_waits.stop()
        connection.close()
