"""Scenario 5: a poison job that kills its worker process (os._exit) every time it runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_pgjobs.models import Job
from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import Size, Workers, worker_args

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4


def test_a_job_that_kills_its_worker_is_dead_lettered_after_max_attempts_and_others_run(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    check, driver = checker("5. poison job"), Driver()
    pool = workers(worker_args(CONCURRENCY, 1))
    pool.start(2)
    driver.enqueue("chaos.poison", 1)
    (poison_id,) = driver.accepted
    feed = driver.feeder("chaos.work", size(400, 2_000) + 1, size(20, 50), seconds=0.02)
    dead: set[int] = set()

    def revive() -> int:
        """The supervisor: replace each worker that died (each death is a fault)."""
        pids = pool.revive()
        dead.update(pids)
        return len(pids)

    drive(check, feed=feed, fault=revive, fault_every=0.2, timeout=size(120, 300))
    deaths = len(dead) + revive()
    assert pool.stop() == [0, 0]

    poison = Job.objects.get(pk=poison_id)
    assert (poison.status, poison.attempts) == ("failed", 3)
    assert poison.last_error.startswith("WorkerLost: lease expired")
    assert [error["type"] for error in poison.errors] == ["WorkerLost"] * 3
    assert deaths == 3
    # A death interrupts at most its worker's jobs in flight.
    report = check.check(driver, faults=deaths, allowance=deaths * CONCURRENCY, faulted_pids=dead)
    check.assert_sound(report)
    assert check.statuses() == {"succeeded": report.jobs - 1, "failed": 1}
    publish(report)
