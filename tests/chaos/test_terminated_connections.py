"""Scenario 3: every second, pg_terminate_backend on a few of the workers' connections, picked at
random among all of them (main loops, handler threads, ledger writers, listeners)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from django.db import connection

from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import Size, Workers, worker_args

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4


def terminate_some_worker_connections(victims: set[int]) -> int:
    """Terminate one to three worker backends; returns how many. Adds their processes to
    `victims` (a worker names its connections chaos:<pid>)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'chaos:%%'"
        )
        backends = cursor.fetchall()
        chosen = random.sample(backends, min(len(backends), random.randint(1, 3)))
        for pid, name in chosen:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            victims.add(int(name.split(":")[1]))
    return len(chosen)


def test_terminating_random_worker_connections_every_second_loses_no_job(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    jobs = size(1_500, 5_000)
    check, driver = checker("3. pg_terminate_backend"), Driver()
    pool = workers(worker_args(CONCURRENCY, 3))
    pool.start(3)
    per_tick = jobs // size(60, 200)
    victims: set[int] = set()

    feed = driver.feeder("chaos.work", jobs, per_tick, seconds=0.02)

    faults = drive(
        check, feed=feed, fault=lambda: terminate_some_worker_connections(victims),
        fault_every=1.0, timeout=size(120, 600),
    )  # fmt: skip
    assert faults >= 5
    assert all(worker.alive() for worker in pool.slots)  # they reconnected, nobody restarted
    assert pool.stop() == [0, 0, 0]
    # A terminated connection can at worst cost its worker the leases of its jobs in flight.
    report = check.check(
        driver, faults=faults, allowance=faults * CONCURRENCY, faulted_pids=victims
    )
    check.assert_sound(report)
    assert check.statuses() == {"succeeded": jobs}
    publish(report)
