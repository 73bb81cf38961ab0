"""The NATS worker's and the relay's own database sessions are a worker's own (runtime/sessions.py):
an idle_session_timeout the database sets does not end them between their statements, and a
NATS worker's commits are durable whatever WORKER_SYNCHRONOUS_COMMIT says (it acknowledges the
message of a job it wrote back). Against a real PostgreSQL and nats-server."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from django_pgjobs.jetstream.relay import relay_until
from django_pgjobs.models import Job
from django_pgjobs.runtime.sessions import LockWaits
from tests import tasks
from tests.conftest import wait_until
from tests.integration.nats_helpers import WorkerThread, queue, relay
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["queue"]  # a fixture


@pytest.fixture
def idle_session_timeout() -> Iterator[None]:
    """Every session opened from now on is ended by the server after 300 ms idle (a managed
    service's idle_session_timeout, PostgreSQL 14+), unless it opts out. The test's own
    connection is closed before it idles (and before the test database is flushed)."""
    options = connection.settings_dict.get("OPTIONS", {})
    connection.settings_dict["OPTIONS"] = {**options, "options": "-c idle_session_timeout=300"}
    connection.close()
    try:
        yield
    finally:
        connection.settings_dict["OPTIONS"] = options
        connection.close()


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings, less what every worker says at start of the queues it serves (a test
    queue is used by no task)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "served by worker" not in r.getMessage()
    ]


def test_an_idle_session_timeout_does_not_end_the_nats_workers_sessions(
    queue: str, idle_session_timeout: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: its session was ended between its reports (one a second), and each next
    # statement failed: "worker …: OperationalError: terminating connection due to
    # idle-session timeout; trying again".
    with caplog.at_level(logging.WARNING, "django_pgjobs"), WorkerThread(queue):
        time.sleep(2.5)  # idle: a report a second, a controls' read
        connection.close()  # the test's own: ended while it slept
        tasks.ledger.using(queue=queue).enqueue(n=1)
        assert relay().round() == 1
        wait_until(lambda: ChaosExecution.objects.count() == 1, timeout=15)
        wait_until(lambda: not Job.objects.filter(queue=queue).exists(), timeout=15)
    assert said(caplog) == []


def test_an_idle_session_timeout_does_not_end_the_relays_session(
    queue: str, idle_session_timeout: None, caplog: pytest.LogCaptureFixture
) -> None:
    relaying = relay()
    stopped = threading.Event()
    thread = threading.Thread(target=relay_until, args=(relaying, stopped), daemon=True)
    with caplog.at_level(logging.WARNING, "django_pgjobs"):
        thread.start()
        try:
            time.sleep(2.0)  # idle rounds every half second
            connection.close()  # the test's own: ended while it slept
            tasks.ledger.using(queue=queue).enqueue(n=1)
            wait_until(lambda: relaying.relayed == 1, timeout=10)
        finally:
            stopped.set()
            thread.join(10)
    assert said(caplog) == []


def test_a_durable_sessions_commits_wait_for_the_disk_whatever_the_setting(settings: Any) -> None:
    # The NATS worker's (durable=True): it acknowledges the message of a job it just wrote
    # back; with synchronous_commit off, a crash of the server could lose the row after that.
    settings.PGJOBS = {**settings.PGJOBS, "WORKER_SYNCHRONOUS_COMMIT": False}
    for durable, expected in ((None, "off"), (True, "on")):
        connection.close()
        lock_waits = LockWaits("default", durable=durable)
        lock_waits.limit_this_thread()
        try:
            with connection.cursor() as cursor:
                cursor.execute("SHOW synchronous_commit")
                assert cursor.fetchone()[0] == expected
        finally:
            lock_waits.stop()
            connection.close()
