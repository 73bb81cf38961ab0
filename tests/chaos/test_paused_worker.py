"""Scenario 4: a worker paused (SIGSTOP) past its lease. Its jobs are reaped and run by another
worker; after SIGCONT every write of the paused worker about them is refused."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable

import pytest
from django.db import connection

from django_pgjobs.models import Job
from tests.chaos.checker import Checker, Driver
from tests.chaos.conftest import Size, Workers, worker_args
from tests.conftest import wait_until
from tests.models import ChaosExecution, ChaosTransition

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4


def owned_by(pid: int, status: str) -> list[Job]:
    return [
        job for job in Job.objects.filter(status=status) if job.worker.split(":")[1] == str(pid)
    ]


def database_now() -> object:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def test_a_worker_paused_past_its_lease_loses_its_jobs_and_every_later_write_is_refused(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    check, driver = checker("4. SIGSTOP past the lease"), Driver()
    pool = workers(worker_args(CONCURRENCY, 1.5))
    (paused,) = pool.start(1)
    driver.enqueue("chaos.work", CONCURRENCY, seconds=3)
    held = wait_until(lambda: len(owned_by(paused.pid, "running")) == CONCURRENCY, timeout=30)
    assert held
    long_jobs = {job.pk for job in owned_by(paused.pid, "running")}
    paused_at = database_now()
    paused.signal(signal.SIGSTOP)

    (other,) = pool.start(1)
    driver.enqueue("chaos.work", size(300, 2_000), seconds=0.01)

    def taken_over() -> bool:
        check.sample()
        return set(owner.pk for owner in owned_by(other.pid, "succeeded")) >= long_jobs

    wait_until(taken_over, timeout=60, interval=0.2)
    for job in Job.objects.filter(pk__in=long_jobs):
        assert job.attempts == 2
        assert job.errors[0]["type"] == "WorkerLost"

    paused.signal(signal.SIGCONT)
    # Its handlers wake up, finish and record their effect: the duplicates the pause caused.
    wait_until(
        lambda: ChaosExecution.objects.filter(pid=paused.pid, ok=True).count() == CONCURRENCY,
        timeout=30,
    )
    wait_until(lambda: check.unfinished() == 0, timeout=size(60, 180))
    assert pool.stop() == [0, 0]
    # It tried to record them and was refused: counted in its activity lines (one or more, as
    # the reports' intervals fell).
    lost = re.findall(r"^last .* lost=(\d+) ", paused.log(), flags=re.MULTILINE)
    assert sum(map(int, lost)) == CONCURRENCY
    refused = ChaosTransition.objects.filter(
        job_id__in=long_jobs, issuer=f"chaos:{paused.pid}", at__gt=paused_at
    )
    assert not refused.exclude(kind="reap").exists()

    report = check.check(driver, faults=1, allowance=CONCURRENCY, faulted_pids={paused.pid})
    check.assert_sound(report)
    assert report.duplicates == CONCURRENCY
    assert check.statuses() == {"succeeded": report.jobs}
    publish(report)
