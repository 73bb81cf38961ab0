"""Scenarios 1 and 7: SIGKILL a random worker every 2 s and start a new one, directly against
PostgreSQL and through PgBouncer in transaction pooling mode (poll only)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection

from tests.chaos.checker import Checker, Driver, Report, drive
from tests.chaos.conftest import Size, Workers, worker_args
from tests.chaos.servers import Bouncer

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4
HANDLER_SECONDS = 0.05  # long enough that every kill interrupts jobs in flight


def soak(pool: Workers, checker: Checker, *, jobs: int, workers: int, timeout: float) -> Report:
    driver = Driver()
    pool.start(workers)
    killed: set[int] = set()

    feed = driver.feeder("chaos.work", jobs, 100, seconds=HANDLER_SECONDS)

    def kill() -> int:
        killed.add(pool.kill_random())
        return 1

    faults = drive(checker, feed=feed, fault=kill, fault_every=2.0, timeout=timeout)
    assert pool.stop() == [0] * workers
    # A kill can interrupt at most the jobs its worker had in flight; each such job may run again.
    report = checker.check(
        driver, faults=faults, allowance=faults * CONCURRENCY, faulted_pids=killed
    )
    checker.assert_sound(report)
    assert checker.statuses() == {"succeeded": jobs}
    assert faults >= 2
    return report


def test_sigkill_every_two_seconds_loses_no_job_and_duplicates_only_interrupted_ones(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    report = soak(
        workers(worker_args(CONCURRENCY, 2)),
        checker("1. SIGKILL soak"),
        jobs=size(2_000, 10_000),
        workers=4,
        timeout=size(120, 600),
    )
    publish(report)


def test_the_sigkill_soak_passes_through_pgbouncer_in_transaction_pooling_mode(
    size: Size,
    workers: Callable[..., Workers],
    checker: Callable[..., Checker],
    publish,
    bouncer: Bouncer,
):
    name = connection.settings_dict["NAME"]
    env = {
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:{bouncer.port}/{name}",
        "PGJOBS_TEST_DATABASE": name,
        "PGJOBS_PGBOUNCER": "1",
    }
    report = soak(
        workers(worker_args(CONCURRENCY, 2, "--no-listen"), env),
        checker("7. SIGKILL soak through PgBouncer"),
        jobs=size(1_000, 10_000),
        workers=size(3, 4),
        timeout=size(120, 600),
    )
    assert "login attempt: db=" + name in bouncer.log()  # the workers did come through it
    publish(report)
