"""jobstats, and the admin's health report, on batches and dependencies: the batches open and
completed without succeeding, and the jobs waiting for others, each counted through its partial
index."""

from __future__ import annotations

import contextlib
import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

import django_pgjobs
from django_pgjobs.models import Batch, Job
from django_pgjobs.observability import stats
from django_pgjobs.testing import run_jobs
from tests import plans, tasks
from tests.factories import JobFactory
from tests.integration.test_commands import as_a_user_who_reads

pytestmark = pytest.mark.django_db

#: What --json printed before batches: each key is still there, named as it was.
KEYS = {
    "at", "status", "reasons", "queues", "workers", "table", "database", "streams", "load",
    "locks", "yielding", "limits",
}  # fmt: skip


def jobstats(*args: str) -> str:
    """What jobstats prints, whatever its verdict."""
    out = StringIO()
    with contextlib.suppress(SystemExit):
        call_command("jobstats", *args, stdout=out)
    return out.getvalue()


def some_of_each() -> None:
    """Two open batches, one completed with a dead letter, one succeeded, and three waiting
    jobs (one of them a member of an open batch)."""
    with django_pgjobs.batch():
        tasks.part.enqueue(n=1, fail=True)
    with django_pgjobs.batch():
        tasks.part.enqueue(n=2)
    run_jobs(queues=["batches"], tasks=[tasks.part])  # one completes, the other succeeds
    first = tasks.step.enqueue(name="first")
    with django_pgjobs.batch():
        tasks.part.using(delay=3600).enqueue(n=3)
    with django_pgjobs.batch():
        tasks.step.using(after=[first]).enqueue(name="in a batch")
    tasks.step.using(after=[first]).enqueue(name="second")
    tasks.step.using(after=[first]).enqueue(name="third")


def test_jobstats_counts_open_and_unsucceeded_batches_and_waiting_jobs_in_text_and_json():
    some_of_each()
    assert Batch.objects.filter(succeeded_at__isnull=False).count() == 1
    text = jobstats()
    assert (
        "batches: 2 open, 1 completed, not succeeded (failed or cancelled jobs to replay); "
        "3 jobs waiting (after=)"
    ) in text.splitlines()
    document = json.loads(jobstats("--json"))
    assert document["batches"] == {"open": 2, "completed_not_succeeded": 1}
    assert document["waiting"] == 3
    assert set(document) >= KEYS  # nothing renamed


def test_without_batches_or_waiting_jobs_jobstats_says_nothing_of_them_but_in_json():
    JobFactory()
    assert "batches:" not in jobstats()
    document = json.loads(jobstats("--json"))
    assert (document["batches"], document["waiting"]) == (
        {"open": 0, "completed_not_succeeded": 0},
        0,
    )


def test_the_counts_read_the_open_batches_and_the_waiting_jobs_partial_indexes():
    Batch.objects.bulk_create(
        Batch(size=1, completed_at="2026-03-02T09:00:00Z", succeeded_at="2026-03-02T09:00:00Z")
        for _ in range(2000)
    )
    Batch.objects.create(size=1)
    JobFactory.create_batch(2000, succeeded=True)
    Job.objects.filter(pk=JobFactory().pk).update(status="waiting")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
        cursor.execute("ANALYZE pgjobs_batch")
    for statement, index in (
        (stats.BATCHES_SQL, "pgjobs_batch_open_idx"),
        (stats.WAITING_SQL, "pgjobs_job_waiting_idx"),
    ):
        plan = plans.explain(statement)
        assert plans.index_scans(plan, index), plans.shown(plan)
        assert not plans.of_type(plan, "Seq Scan"), plans.shown(plan)
    assert stats.batch_stats() == stats.BatchStats(open=1, completed_not_succeeded=0, waiting=1)


def test_a_database_user_who_may_not_read_the_batches_still_gets_the_report():
    """A monitoring role granted the tables jobstats read before batches keeps its report; the
    batches are said to be unread, and how to read them."""
    some_of_each()
    as_a_user_who_reads(
        "pgjobs_job", "pgjobs_queue", "pgjobs_queuestat", "pgjobs_rollup", "pgjobs_worker"
    )
    text = jobstats()
    assert (
        "batches: not counted: this database user may not read pgjobs_batch (grant it SELECT); "
        "3 jobs waiting (after=)"
    ) in text.splitlines()
    document = json.loads(jobstats("--json"))
    assert (document["batches"], document["waiting"]) == (None, 3)


def test_the_health_report_page_shows_them_linked_to_the_batches_and_the_waiting_jobs(
    admin_client,
):
    some_of_each()
    page = admin_client.get(reverse("admin:pgjobs_queue_report"))
    content = page.content.decode()
    batches = reverse("admin:pgjobs_batch_changelist")
    assert f'<a href="{batches}?state=open">2</a>' in content
    assert f'<a href="{batches}?state=completed">1</a>' in content
    waiting = reverse("admin:pgjobs_job_changelist") + "?status__exact=waiting"
    assert f'<a href="{waiting}">3</a>' in content
    assert admin_client.get(waiting).context["cl"].result_count == 3
