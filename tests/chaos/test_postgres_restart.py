"""Scenario 2: PostgreSQL restarts mid-run, in fast and in immediate (crash) mode, on a
throwaway cluster the test starts itself. The workers ride it out and finish everything."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import ALIAS, Size, Workers, worker_args
from tests.chaos.servers import Cluster

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4


def test_workers_survive_fast_and_immediate_restarts_and_finish_every_job(
    size: Size,
    workers: Callable[..., Workers],
    checker: Callable[..., Checker],
    publish,
    cluster: Cluster,
):
    jobs = size(1_500, 5_000)
    check = checker("2. PostgreSQL restarts", connect=cluster.connect)
    driver = Driver(ALIAS)
    env = {"DATABASE_URL": cluster.url(), "PGJOBS_TEST_DATABASE": ""}
    pool = workers(worker_args(CONCURRENCY, 3), env)
    pool.start(size(2, 4))
    restarts = ["fast", "immediate"] * size(1, 2)

    per_tick = jobs // size(80, 200)  # enqueue all through the restarts, not just before them

    feed = driver.feeder("chaos.work", jobs, per_tick, seconds=0.02)

    def restart() -> int:
        if not restarts:
            return 0
        cluster.restart(restarts.pop(0))
        return 1

    faults = drive(check, feed=feed, fault=restart, fault_every=2.5, timeout=size(180, 600))
    assert not restarts, "the jobs ran out before every restart was done"
    assert all(worker.alive() for worker in pool.slots)  # nobody had to be restarted
    logs = "".join(worker.log() for worker in pool.slots)
    assert "cannot reach the database" in logs  # the workers noticed, and said so
    assert pool.stop() == [0] * len(pool.slots)
    # A restart cuts every worker off at once: each in-flight job may run again.
    report = check.check(
        driver, faults=faults, allowance=faults * len(pool.slots) * CONCURRENCY,
        faulted_pids=pool.pids(), crashes=True,
    )  # fmt: skip
    report.details["refused_enqueues"] = driver.refused
    check.assert_sound(report)
    assert check.statuses() == {"succeeded": report.jobs}
    publish(report)
