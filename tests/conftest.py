"""Shared fixtures: a second connection, waiting with a deadline, threads released together."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-full",
        action="store_true",
        help="run the fault-injection suite (tests/chaos) at full size; also CHAOS_FULL=1",
    )


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


@pytest.fixture
def other_connection(transactional_db: None) -> Iterator[psycopg.Connection[Any]]:
    """A second, independent session on the test database (autocommit)."""
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
