"""A migration that changes the type of a column the worker's prepared statements return, run
while the worker is busy: PostgreSQL refuses those statements on its connection until they
are prepared again. No job may pay for it: the outcomes in hand are recorded after the
reconnect, never taken for outcomes the database refused (which dead-letters them)."""

from __future__ import annotations

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
    for n in range(200):
        Job.objects.enqueue("tests.tasks.record", {"n": n, "seconds": 0.05})
    wait_until(lambda: _succeeded() >= 100, 60)  # well into the backlog: its turns prepared
    other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE int4")
    try:
        wait_until(lambda: not Job.objects.filter(status__in=["ready", "running"]).exists(), 60)
    finally:
        other_connection.execute("ALTER TABLE pgjobs_job ALTER COLUMN priority TYPE int2")
    worker.signal(15)
    assert worker.wait(30) == 0
    log = worker.log()
    assert _succeeded() == 200, log[-3000:]
    assert "a migration changed the job table" in log, log[-3000:]
    assert "refused" not in log, log[-3000:]
