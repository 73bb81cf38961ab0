"""Progress reports under a real runjobs process: thousands of reports cost a few writes, and an
abandoned attempt's reports never reach the attempt that replaced it."""

from __future__ import annotations

import signal

import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.runtime.leases import PROGRESS_INTERVAL
from django_pgjobs.status import Status
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def row_updates() -> int:
    """Updates of pgjobs_job rows counted by PostgreSQL's statistics (every session's, once
    they have sent them: a worker that exited has)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'")
        return int(cursor.fetchone()[0])


def test_thousands_of_reports_are_written_about_once_a_second(start_worker) -> None:
    before = row_updates()
    job = Job.objects.enqueue("tests.tasks.reports_progress", {"steps": 3000, "pause": 0.001})
    worker = start_worker("--lease", "60")
    wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.SUCCEEDED, timeout=60)
    row = Job.objects.get(pk=job.pk)
    worker.signal(signal.SIGTERM)
    assert worker.wait(15) == 0  # its sessions have sent their statistics
    seconds = (row.finished_at - row.started_at).total_seconds()

    # The claim, the outcome, and a write a second at most (the handler reported 3,000 times).
    # Statistics that are late can only make the count lower, never higher.
    writes = wait_until(lambda: (count := row_updates() - before) >= 3 and count, timeout=15)
    assert 3 <= writes <= 2 + seconds / PROGRESS_INTERVAL + 1, (writes, seconds)
    assert row.progress["done"] == 3000 and row.progress["note"] == "step 3000 of 3000"


def test_a_handler_past_its_time_limit_that_goes_on_reporting_never_writes_over_its_retry(
    start_worker,
) -> None:
    job = Job.objects.enqueue("tests.tasks.overruns_then_retries_quietly", {"seconds": 1.5})
    start_worker("--concurrency", "2", "--lease", "3")
    wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.SUCCEEDED, timeout=30)

    row = Job.objects.get(pk=job.pk)
    assert row.attempts == 2
    assert [error["type"] for error in row.errors] == ["django_pgjobs.errors.JobTimeout"]
    # All through attempt 2 (progress rounds every second), the abandoned attempt 1 reported every
    # 10 ms for the same job, on the same worker: none of it was written over the new claim.
    assert row.progress is None
