"""One plain `manage.py migrate`, from the first migration to the last, on a job table that is
busy: enqueues every 50 ms, and a reporting session whose transactions keep a lock on the table
for seconds. No enqueue may wait long behind a migration's lock request, and the migration must
complete all the same."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import connection_kwargs
from tests.crash.conftest import manage, scratch_database

#: The reporting session's transactions: each open this long (s), one after another. One alone
#: would not do: a concurrent index drop (0004) waits for the transactions it finds, so the
#: column adds after it would meet none.
REPORT_SECONDS = 2.5
REPORTS = 5
ENQUEUE_EVERY = 0.05
#: An enqueue's longest acceptable wait (s), behind the migration's lock requests.
LONGEST_ENQUEUE = 1.0

ENQUEUE = (
    "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts) "
    "VALUES (gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3)"
)


@pytest.fixture
def first_install(transactional_db: None) -> Iterator[str]:
    """A database of its own at the first migration, with jobs in it."""
    with scratch_database("lock_waits") as name:
        first = manage("migrate", "pgjobs", "0001", PGJOBS_TEST_DATABASE=name)
        assert first.returncode == 0, first.stdout + first.stderr
        database = {**connection_kwargs(), "dbname": name}
        with psycopg.connect(**database, autocommit=True) as session:
            session.execute(
                "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, run_at) "
                "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3, "
                "now() + n * interval '1 second' FROM generate_series(-5000, 4999) AS n"
            )
        yield name


class Reports(threading.Thread):
    """A reporting session: REPORTS transactions one after another, each holding an ACCESS SHARE
    lock on the job table (it read the table) for REPORT_SECONDS."""

    def __init__(self, database: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.pid = 0
        self.holding = threading.Event()

    def run(self) -> None:
        with psycopg.connect(**self.database) as session:
            self.pid = session.info.backend_pid
            for _ in range(REPORTS):
                session.execute("SELECT count(*) FROM pgjobs_job")
                self.holding.set()
                time.sleep(REPORT_SECONDS)  # the report's transaction stays open
                session.commit()


class Enqueues(threading.Thread):
    """An enqueue every ENQUEUE_EVERY seconds, each in its own transaction, timed."""

    def __init__(self, database: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.waits: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(**self.database, autocommit=True) as session:
            while not self.stop.is_set():
                started = time.monotonic()
                session.execute(ENQUEUE)
                self.waits.append(time.monotonic() - started)
                self.stop.wait(ENQUEUE_EVERY)


def test_migrate_behind_long_transactions_keeps_every_enqueue_under_a_second(first_install):
    database = {**connection_kwargs(), "dbname": first_install}
    enqueues, reports = Enqueues(database), Reports(database)
    enqueues.start()
    reports.start()
    try:
        assert reports.holding.wait(10)
        migrate = manage("migrate", PGJOBS_TEST_DATABASE=first_install)
    finally:
        enqueues.stop.set()
        enqueues.join(30)
        reports.join(30)
    output = migrate.stdout + migrate.stderr
    assert migrate.returncode == 0, output

    longest = max(enqueues.waits)
    assert longest < LONGEST_ENQUEUE, (longest, sorted(enqueues.waits)[-5:], output)
    assert len(enqueues.waits) > REPORTS * REPORT_SECONDS / ENQUEUE_EVERY / 4  # they kept on
    # Completed: nothing left to apply.
    assert manage("migrate", "--check", PGJOBS_TEST_DATABASE=first_install).returncode == 0
    # The column adds waited for the reports, in tries that name the session holding the lock.
    assert f"waits for a lock on pgjobs_job: pid {reports.pid} holds one" in output, output
