"""Scenario 6: a retry storm. Every job fails against a dependency that is down until it
recovers; the backoff (full jitter, base 0.5 s, cap 4 s) spreads the retries over time."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from django.db import connection

from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import Size, Workers, worker_args
from tests.chaos.tasks import STORM_BACKOFF

pytestmark = pytest.mark.django_db(transaction=True)


def executions_per_second() -> list[int]:
    """Executions (failed and successful) in each second since the first one, in order."""
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH e AS (SELECT at - min(at) OVER () AS since FROM chaos_execution) "
            "SELECT floor(extract(epoch FROM since))::int AS second, count(*) FROM e "
            "GROUP BY 1 ORDER BY 1"
        )
        counts = dict(cursor.fetchall())
    return [counts.get(second, 0) for second in range(max(counts) + 1)]


def test_a_retry_storm_is_spread_by_the_backoff_and_every_job_succeeds_after_recovery(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    jobs, outage = size(500, 1_000), size(10, 20)
    check, driver = checker("6. retry storm"), Driver()
    pool = workers(worker_args(8, 5))
    pool.start(2)
    recovers_at = time.time() + outage
    driver.enqueue("chaos.flaky", jobs, recovers_at=recovers_at)
    drive(check, timeout=outage + 60)
    assert pool.stop() == [0, 0]
    report = check.check(driver)
    check.assert_sound(report)
    assert report.duplicates == 0
    assert check.statuses() == {"succeeded": jobs}  # none ran out of attempts

    histogram = executions_per_second()
    per_job = report.executions / jobs
    report.details.update(
        outage_seconds=outage, attempts_per_job=round(per_job, 1), executions_per_second=histogram
    )
    # Backed off, a job tries a few times a minute, not hundreds of times: about 3 tries in
    # the first 1.75 s, then one per 2 s on average (half the cap).
    assert per_job < 4 + outage / 1.5, histogram
    # Spread, not in lock step: in the second half of the outage, no second sees more than
    # three quarters of the jobs (the average is half of them, the cap being 4 s).
    assert max(histogram[outage // 2 : outage - 1]) < jobs * 0.75, histogram
    # Recovered, every job succeeds within the cap (plus a margin for a busy machine).
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM max(finished_at)) FROM pgjobs_job")
        (last,) = cursor.fetchone()
    assert float(last) < recovers_at + STORM_BACKOFF.cap + 5
    publish(report)
