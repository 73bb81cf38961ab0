"""A claim reads O(batch) index entries, whatever the number of scheduled jobs waiting."""

from __future__ import annotations

import json

import pytest
from django.db import connection

from django_pgjobs.data import sql
from django_pgjobs.data.jobs import turn_params
from django_pgjobs.models import Job

pytestmark = pytest.mark.django_db


def _fill(due: int, scheduled: int) -> None:
    """`scheduled` jobs at priority 5 waiting an hour (enqueued with a delay, as a user would),
    and `due` jobs at priority 0, in the default queue."""
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * scheduled, priority=5, delay=3600)
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * due)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")


def _claim_plan(limit: int) -> dict:
    params = turn_params([], [], ["default"], worker="w1", limit=limit, lease=60.0, results={})
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql.SETTLE_AND_CLAIM}", params)
        (plan,) = cursor.fetchone()
    return (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]


def _buffers(plan: dict) -> int:
    return plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)


def _scans(plan: dict) -> list[dict]:
    found = [plan] if "Index Name" in plan else []
    for child in plan.get("Plans", []):
        found += _scans(child)
    return found


def test_waiting_jobs_of_a_higher_priority_are_never_walked_by_a_claim():
    _fill(due=1_000, scheduled=200_000)

    plan = _claim_plan(limit=10)

    scans = {scan["Index Name"]: scan for scan in _scans(plan)}
    claim = scans["pgjobs_job_claim_idx"]
    # The claim index holds only due jobs: its scan reads the 10 it takes, and none of the
    # 200,000 waiting ones is read or filtered out.
    assert claim["Actual Rows"] == 10
    assert claim.get("Rows Removed by Filter", 0) == 0
    # Waiting jobs are found by run_at: none has come due, so the scan reads nothing.
    assert scans["pgjobs_job_scheduled_idx"]["Actual Rows"] == 0
    # The whole statement touches a few dozen buffers (walking the waiting jobs took ~1,200).
    assert _buffers(plan) < 200, json.dumps(plan, indent=1)
    assert len(Job.objects.filter(status="running")) == 10


def test_a_scheduled_job_that_came_due_is_claimed_in_priority_order():
    urgent = Job.objects.enqueue("tests.tasks.noop", priority=9, delay=3600)
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 5)
    Job.objects.filter(pk=urgent.pk).update(run_at=urgent.created_at)  # its hour has passed
    assert Job.objects.get(pk=urgent.pk).scheduled  # not yet moved to the claim index

    (first,) = Job.objects.claim(["default"], worker="w1", limit=1)

    assert first.pk == urgent.pk and not first.scheduled
