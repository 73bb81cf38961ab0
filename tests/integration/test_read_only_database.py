"""A database that refuses writes (a standby after a failover, or default_transaction_read_only):
a worker's connection that reaches one is the connection's fault, made again until it reaches a
node that takes writes, and the worker does not say the database is back before then."""

from __future__ import annotations

import logging
import threading

import psycopg
import pytest
from django.db import DatabaseError, connection

from django_pgjobs.data import rows
from django_pgjobs.models import Job
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import connection_kwargs, read_only_sessions, wait_until
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_refused_write_is_the_connections_fault() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")
    try:
        with pytest.raises(DatabaseError) as raised, connection.cursor() as cursor:
            cursor.execute("UPDATE pgjobs_job SET priority = 0")
        assert rows.refuses_writes(raised.value) and rows.connection_lost(raised.value)
        with pytest.raises(DatabaseError) as raised:
            rows.check_writable("default")
        assert rows.refuses_writes(raised.value)
    finally:
        connection.close()  # the session setting goes with it
    rows.check_writable("default")


def end_the_workers_sessions() -> None:
    # This test database's only: the other test processes' workers (another xdist worker's
    # database, the other CI leg's) are not to be cut off mid-test (a NATS worker's last report
    # was lost that way, and another test's worker planned again).
    with psycopg.connect(**connection_kwargs(), autocommit=True) as session:
        session.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'pgjobs worker%%'"
        )


def test_a_worker_reconnected_to_a_read_only_node_is_not_back_until_it_takes_writes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: a worker whose every handler was busy wrote nothing in its first turn on the
    # standby and said "the database is back"; and a refused write was not the connection's
    # fault: a chore kept failing on it for good (a NATS worker's reports), never reconnecting.
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4})
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run, name="worker-loop")
    with (
        read_only_sessions("worker-loop") as read_only,
        caplog.at_level(logging.INFO, "django_pgjobs"),
    ):
        thread.start()
        try:
            wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=20)  # busy
            read_only.refusing = True
            end_the_workers_sessions()  # a failover: reconnected, to a node refusing writes
            wait_until(
                lambda: any("refuses writes" in r.getMessage() for r in caplog.records),
                timeout=20,
            )
            assert not any("is back" in r.getMessage() for r in caplog.records)
            read_only.refusing = False  # the primary again: the next reconnection reaches it
            wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.SUCCEEDED, timeout=30)
        finally:
            worker.stop()
            thread.join(20)
    said = [r.getMessage() for r in caplog.records]
    refused = [line for line in said if "refuses writes" in line]
    assert "a standby, or read-only" in refused[0] and "connecting again" in refused[0]
    back = [n for n, line in enumerate(said) if "the database is back" in line]
    assert back and back[0] > said.index(refused[-1])
