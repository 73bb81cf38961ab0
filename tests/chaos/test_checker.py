"""The checker itself: each violation it exists to report, produced on purpose, is reported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection

from django_pgjobs.models import Job
from tests.chaos.checker import Checker, Driver
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)

OWNER, OTHER = "host:4242:aa", "host:5151:bb"


@pytest.fixture(autouse=True)
def _own_name_restored():
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET application_name")


def act_as(worker: str) -> None:
    """Make this connection's writes look like they come from `worker`'s process."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('application_name', %s, false)", [_issuer(worker)])


def _issuer(worker: str) -> str:
    return f"chaos:{worker.split(':')[1]}"


def claimed(driver: Driver, worker: str = OWNER) -> Job:
    driver.enqueue("chaos.work", 1)
    act_as(worker)
    (job,) = Job.objects.claim(["default"], worker=worker)
    return job


def ran(job: Job, *, pid: int = 4242, ok: bool = True) -> None:
    ChaosExecution.objects.create(
        job_id=job.pk, attempt=job.attempts, worker=job.worker, pid=pid, ok=ok
    )


def test_a_clean_run_reports_nothing(checker: Callable[..., Checker]):
    check, driver = checker("clean"), Driver()
    job = claimed(driver)
    ran(job)
    assert Job.objects.complete(job)
    report = check.check(driver)
    check.assert_sound(report)
    assert (report.jobs, report.executions, report.duplicates) == (1, 1, 0)


def test_a_success_written_by_a_process_that_does_not_hold_the_claim_is_a_stale_write(
    checker: Callable[..., Checker],
):
    check, driver = checker("stale"), Driver()
    job = claimed(driver)
    ran(job)
    act_as(OTHER)  # a process that kept the owner's claim details, e.g. one paused past its lease
    assert Job.objects.complete(job)
    assert check.check(driver).stale_writes == 1


def test_a_success_recorded_before_its_handler_finished_is_a_stale_write(
    checker: Callable[..., Checker],
):
    check, driver = checker("early"), Driver()
    job = claimed(driver)
    assert Job.objects.complete(job)
    ran(job)
    assert check.check(driver).stale_writes == 1


def test_an_unfinished_job_is_lost_and_an_expired_lease_left_alone_is_stuck(
    checker: Callable[..., Checker],
):
    check, driver = checker("lost"), Driver()
    driver.enqueue("chaos.work", 1)
    job = claimed(driver)
    Job.objects.filter(pk=job.pk).update(leased_until=job.leased_until.replace(year=2000))
    report = check.check(driver)
    assert (report.lost, report.stuck) == (2, 1)


def test_an_execution_nobody_claimed_is_unexpected(checker: Callable[..., Checker]):
    check, driver = checker("unexpected"), Driver()
    job = claimed(driver)
    ran(job)
    job.attempts = 7  # an attempt that was never claimed
    ran(job)
    assert check.check(driver).unexpected == 1


def test_a_job_run_to_the_end_twice_is_a_duplicate_that_only_a_fault_of_its_first_runner_explains(
    checker: Callable[..., Checker],
):
    check, driver = checker("duplicate"), Driver()
    first = claimed(driver)
    ran(first, pid=4242)
    Job.objects.filter(pk=first.pk).update(status="ready")  # as if reaped
    act_as(OTHER)
    (second,) = Job.objects.claim(["default"], worker=OTHER)
    ran(second, pid=5151)
    assert Job.objects.complete(second)
    assert check.check(driver, faulted_pids=set()).unexplained_duplicates == 1
    report = check.check(driver, allowance=1, faulted_pids={4242})
    assert (report.duplicates, report.unexplained_duplicates) == (1, 0)
    check.assert_sound(report)
