"""The test tiers, and shared fixtures: a second connection, waiting with a deadline, threads
released together."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.db.backends.signals import connection_created

from django_pgjobs.runtime.sessions import application_name


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-full",
        action="store_true",
        help="run the fault-injection suite (tests/chaos) at full size; also CHAOS_FULL=1",
    )


#: Each test's tier (a marker, registered in pyproject.toml) by the folder it is in, cheapest
#: first; `python3 dev.py test` runs them in this order and stops at the first that fails.
TIERS = {
    "tests/unit": "unit",  # no database
    "tests/integration": "integration",  # real PostgreSQL, in this process
    "example_project": "integration",  # the example shop's own tests (Django's TestCase)
    "tests/property": "property",  # Hypothesis state machines against real PostgreSQL
    "tests/crash": "crash",  # real runjobs processes, real signals
    "tests/chaos": "chaos",  # fault injection: killed workers, restarted or cut-off databases
    "tests/browser": "browser",  # a real browser through the admin
}


#: The crash tests that go through Django's own machinery with a process of ours: its Tasks
#: framework, migrate on an older schema, its system checks, a first run; and (by name, below)
#: its autoreloader (runjobs --reload). They are marked every_django: the Django 6 leg runs
#: these of the crash tier (dev.py, LEGS); the rest, and the chaos tier, test our processes and
#: the database's faults, which Django's version does not change (the admin and jobstats are
#: tested on every leg by the integration and browser tiers).
EVERY_DJANGO = {
    "test_django_tasks_processes.py", "test_upgrade.py", "test_other_backends.py",
    "test_first_run.py",
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, so that no test file has to remember to."""
    for item in items:
        path = Path(item.path).resolve().relative_to(config.rootpath).as_posix()
        tier = next((t for folder, t in TIERS.items() if path.startswith(f"{folder}/")), None)
        if tier is None:
            raise pytest.UsageError(
                f"{path} is in no tier's folder: move it into one of {', '.join(TIERS)}, "
                "or give its folder a tier in TIERS (tests/conftest.py)"
            )
        item.add_marker(tier)
        if tier == "crash" and (Path(item.path).name in EVERY_DJANGO or "reload" in item.name):
            item.add_marker("every_django")


def connection_kwargs() -> dict[str, Any]:
    """psycopg connect() arguments for the database the tests use (the test database)."""
    settings = connection.settings_dict
    kwargs = {
        "dbname": settings["NAME"],
        "user": settings["USER"] or None,
        "password": settings["PASSWORD"] or None,
        "host": settings["HOST"] or None,
        "port": settings["PORT"] or None,
    }
    return {key: value for key, value in kwargs.items() if value is not None}


def end_sessions_of(worker: str) -> int:
    """Terminate the sessions of `worker` (named after it) in the test database; how many."""
    with psycopg.connect(**connection_kwargs(), autocommit=True) as session:
        row = session.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
            "FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
            [application_name(worker)],
        ).fetchone()
        return int(row[0]) if row else 0


@pytest.fixture
def other_connection(transactional_db: None) -> Iterator[psycopg.Connection[Any]]:
    """A second, independent session on the test database (autocommit). A test using it is
    transactional (it sees only committed rows), whatever its django_db mark says."""
    with psycopg.connect(**connection_kwargs(), autocommit=True) as other:
        yield other


@pytest.fixture
def signal_handlers_restored() -> Iterator[None]:
    """runjobs installs SIGTERM/SIGINT handlers; give pytest its own back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def statistics_count(live: int, table: str = "pgjobs_job", timeout: float = 10) -> None:
    """Wait until PostgreSQL's statistics count at least `live` live rows in `table` (committed
    rows: a transaction=True test). A session sends its counts at most once a second, so this
    asks the test's own session to send them now."""

    def counted() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
            cursor.execute("SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = %s", [table])
            return int(cursor.fetchone()[0]) >= live

    wait_until(counted, timeout)


def run_together(count: int, work: Callable[[int], object]) -> list[object]:
    """Run work(0..count-1) on threads released together, each with its own connection."""
    start = threading.Barrier(count)
    results: list[object] = [None] * count

    def run(n: int) -> None:
        try:
            start.wait()
            results[n] = work(n)
        except BaseException as error:
            results[n] = error
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class ReadOnlySessions:
    """While `refusing`, every session a thread named in `threads` opens is read-only, as those
    of a node that refuses writes (a standby after a failover) are."""

    def __init__(self, *threads: str) -> None:
        self.threads, self.refusing = set(threads), False

    def __call__(self, sender: object, connection: Any, **kwargs: object) -> None:
        if self.refusing and threading.current_thread().name in self.threads:
            with connection.cursor() as cursor:
                cursor.execute("SET default_transaction_read_only = on")


@contextmanager
def read_only_sessions(*threads: str) -> Iterator[ReadOnlySessions]:
    """A ReadOnlySessions of `threads`, for the block (connection_created's receiver)."""
    receiver = ReadOnlySessions(*threads)
    connection_created.connect(receiver, weak=False)
    try:
        yield receiver
    finally:
        connection_created.disconnect(receiver)
