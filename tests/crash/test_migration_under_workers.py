"""A migration that changes the type of a column the worker's prepared statements return, run
while the worker is busy: PostgreSQL refuses those statements on its connection until they
are prepared again. No job may pay for it: the outcomes in hand are recorded after the
reconnect, never taken for outcomes the database refused (which dead-letters them)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.crash.conftest import start_worker  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def _succeeded() -> int:
    return Job.objects.filter(status=Status.SUCCEEDED).count()


def test_a_migration_under_a_busy_worker_costs_no_job_its_outcome(
    start_worker,  # noqa: F811
    other_connection: Any,
):
    worker = start_worker("--concurrency", "4", "--no-listen", "--poll-interval", "0.5")
    for n in range(400):
        Job.objects.enqueue("tests.tasks.record", {"n": n, "seconds": 0.05})
    wait_until(lambda: _succeeded() >= 40, 60)  # into the backlog: its turns prepared
    # Under a backlog the worker plans its statements again every second, and a new plan's
    # statement runs unprepared for its first few executions: a migration landing then meets
    # nothing prepared. So the column changes type, back and forth, until one lands on a
    # prepared statement (each change makes every statement prepared before it unfit).
    try:
        for column_type in ["int4", "int2"] * 10:
            if "a migration changed the job table" in worker.log():
                break
            other_connection.execute(
                f"ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE {column_type}"
            )
            time.sleep(0.4)
        wait_until(lambda: not Job.objects.filter(status__in=["ready", "running"]).exists(), 60)
    finally:
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE int2")
    worker.signal(15)
    assert worker.wait(30) == 0
    log = worker.log()
    assert "a migration changed the job table" in log, log[-3000:]
    assert _succeeded() == 400, log[-3000:]
    assert "refused" not in log, log[-3000:]
