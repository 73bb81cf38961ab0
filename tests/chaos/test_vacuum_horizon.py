"""Scenario 9: a long-running transaction holds back vacuum's horizon while the queue runs.
Nothing breaks; the dead rows pile up until the transaction ends, then vacuum removes them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection

from django_pgjobs.observability import dbstats
from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import Size, Workers, open_test_database, worker_args

pytestmark = pytest.mark.django_db(transaction=True)


def dead_rows_after_vacuum() -> int:
    with connection.cursor() as cursor:
        cursor.execute("VACUUM pgjobs_job")
        cursor.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'")
        return int(cursor.fetchone()[0])


def test_a_transaction_holding_back_vacuum_does_not_stop_the_queue(
    size: Size, workers: Callable[..., Workers], checker: Callable[..., Checker], publish
):
    jobs = size(2_000, 10_000)
    check, driver = checker("9. vacuum held back"), Driver()
    with open_test_database() as holder:
        # A snapshot taken and kept, like a forgotten `BEGIN` in a psql session or a long report.
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgjobs_job")
        pool = workers(worker_args(8, 5))
        pool.start(2)
        drive(check, feed=driver.feeder("chaos.work", jobs, size(100, 250)), timeout=size(90, 300))
        assert pool.stop() == [0, 0]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s",
                [holder.info.backend_pid],
            )
            (horizon_age,) = cursor.fetchone()
        # What an operator sees: jobstats names the snapshot holding the horizon back.
        shown = dbstats.database_stats()
        assert shown.oldest_snapshot_query == "SELECT count(*) FROM pgjobs_job"
        assert shown.oldest_snapshot_seconds > 0
        held = dead_rows_after_vacuum()
        holder.execute("COMMIT")
    released = dead_rows_after_vacuum()

    report = check.check(driver)
    check.assert_sound(report)
    assert report.duplicates == 0
    assert check.statuses() == {"succeeded": jobs}
    # Every claim and every completion left a dead row version vacuum could not remove...
    assert held >= jobs, (held, released)
    assert horizon_age > jobs / 100  # the held snapshot is older than the queue's transactions
    # ...until the transaction ended.
    assert released < held / 10
    report.details.update(
        horizon_age_xids=horizon_age, dead_rows_held=held, dead_rows_after_release=released
    )
    publish(report)
