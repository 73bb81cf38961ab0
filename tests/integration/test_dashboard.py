"""The jobs dashboard (admin/dashboard.py): the jobs by state, per queue and per task, each a
link to its list; each task's runs over the last hour and day from the rolled-up statistics; and
the statistics as workers write them (a report's per-task tally) rolled up by the database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from django.db.models.functions import Now
from django.urls import reverse

from django_pgjobs.models import QueueStat, Rollup
from django_pgjobs.outcomes import Outcome
from django_pgjobs.runtime.reporting import ActivityTally
from tests.factories import JobFactory
from tests.integration.test_admin import staff

pytestmark = pytest.mark.django_db

DASHBOARD = reverse("admin:pgjobs_job_dashboard")


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {state["key"]: state["count"] for state in rows}


def test_the_dashboard_counts_each_state_per_queue_and_task_each_a_link(admin_client):
    due = Now() - timedelta(seconds=1)  # the test's transaction began after the app's clock read
    JobFactory.create_batch(3, queue="emails", task="tests.tasks.send_email", run_at=due)
    JobFactory(queue="emails", task="tests.tasks.send_email", run_at=Now() + timedelta(hours=1))
    JobFactory(queue="emails", task="tests.tasks.noop", running=True)
    JobFactory.create_batch(2, queue="emails", task="tests.tasks.noop", expired=True)
    JobFactory(queue="default", dead=True)
    JobFactory(queue="default", attempts=1, run_at=due)  # due again after a failed attempt
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    assert counts(page.context["totals"]) == {
        "due": 4, "scheduled": 1, "running": 3, "expired": 2, "retrying": 1, "failed": 1,
    }  # fmt: skip
    emails = next(row for row in page.context["queues"] if row["queue"].queue == "emails")
    assert counts(emails["states"]) == {
        "due": 3, "scheduled": 1, "running": 3, "expired": 2, "retrying": 0, "failed": 0,
    }  # fmt: skip
    stuck = next(state for state in emails["states"] if state["key"] == "expired")
    assert parse_qs(urlparse(stuck["url"]).query) == {
        "status__exact": ["stuck"], "queue": ["emails"],
    }  # fmt: skip
    # The link lists exactly what the number counts.
    listed = admin_client.get(stuck["url"])
    assert listed.status_code == 200 and listed.context["cl"].result_count == 2
    noop = next(row for row in page.context["tasks"] if row["figures"].task == "tests.tasks.noop")
    assert counts(noop["states"])["expired"] == 2 and counts(noop["states"])["failed"] == 1
    assert "stuck" in page.content.decode()


def report(worker: str, queue: str, outcomes: list[tuple[str, str, float]], ago: float = 0):
    """A worker's report as the worker writes it: its tally's rows, `ago` seconds back."""
    tally = ActivityTally()
    for task, outcome, seconds in outcomes:
        tally.finished(JobFactory.build(queue=queue, task=task), outcome, seconds)
    rows = tally.rows(worker, 10.0, [queue])
    for row in rows:
        row.at = Now() - timedelta(seconds=ago)
    QueueStat.objects.bulk_create(rows)


def test_each_tasks_runs_failure_rate_and_durations_over_the_hour_and_the_day(admin_client):
    # Two workers this minute; one more two hours ago (in the day, not the hour).
    report("w1", "emails", [("tests.tasks.send_email", Outcome.SUCCEEDED, 0.03)] * 8)
    report("w2", "emails", [("tests.tasks.send_email", Outcome.RETRIED, 2.0),
                            ("tests.tasks.send_email", Outcome.FAILED, 40.0)])  # fmt: skip
    report("w1", "emails", [("tests.tasks.send_email", Outcome.SUCCEEDED, 0.03)] * 10, ago=7200)
    page = admin_client.get(DASHBOARD)
    (row,) = [r for r in page.context["tasks"] if r["figures"].task == "tests.tasks.send_email"]
    hour, day = row["figures"].hour, row["figures"].day
    assert (hour.runs, hour.failure_rate) == (10, 0.2)
    assert (day.runs, day.failure_rate) == (20, 0.1)
    assert 0.01 <= hour.duration_p50 <= 0.05  # in the 10–50 ms bucket
    assert 30 <= hour.duration_p95 <= 60
    text = page.content.decode()
    assert "20%" in text and "10%" in text


def test_the_database_rolls_up_reports_by_minute_and_hour_per_queue_and_task():
    report("w1", "emails", [("tests.tasks.send_email", Outcome.SUCCEEDED, 0.03)] * 3)
    report("w2", "emails", [("tests.tasks.send_email", Outcome.FAILED, 0.03)])
    for step in (60, 3600):
        (task,) = Rollup.objects.filter(kind="task", step=step)
        assert (task.name, task.succeeded, task.failed, sum(task.durations)) == (
            "tests.tasks.send_email", 3, 1, 4,
        )  # fmt: skip
        (queue,) = Rollup.objects.filter(kind="queue", step=step)
        assert (queue.name, queue.succeeded, queue.failed) == ("emails", 3, 1)


def test_without_view_permission_the_dashboard_is_refused():
    assert staff().get(DASHBOARD).status_code == 403
    assert staff("view_job").get(DASHBOARD).status_code == 200
