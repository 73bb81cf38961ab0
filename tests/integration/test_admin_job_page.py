"""A job as the operator reads it: stuck jobs (judged by the database's clock), where its time
went, its worker's other jobs, where an action from its page leads, a replay into a NATS
stream, and an error history that says what it no longer keeps."""

from __future__ import annotations

import html
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgjobs.models import Dependency, Job
from django_pgjobs.status import Status
from tests.factories import JobFactory
from tests.integration.test_admin import DEAD, JOBS, act, detail, messages_of, reload, staff
from tests.integration.test_admin_search import fill

pytestmark = pytest.mark.django_db


def text_of(response: Any) -> str:
    return html.unescape(response.content.decode())


def listed(client: Any, query: dict[str, str]) -> list[Any]:
    return [job.pk for job in client.get(JOBS, query).context["cl"].result_list]


def stuck_job(**fields: Any) -> Job:
    """A running job whose lease ran out 3 minutes ago by the database's clock (its progress
    report still says 50%)."""
    job = JobFactory(expired=True, progress={"done": 5, "total": 10}, **fields)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET leased_until = now() - interval '3 minutes' WHERE id = %s",
            [job.pk],
        )
    return job


# ---- stuck ----------------------------------------------------------------------------------


def test_a_running_job_whose_lease_ran_out_shows_as_stuck_on_the_list_and_its_page(
    admin_client,
):
    stuck = stuck_job()
    healthy = JobFactory(running=True, progress={"done": 5, "total": 10})
    page = text_of(admin_client.get(JOBS))
    assert page.count('class="pgjobs-status stuck"') == 1
    assert "lease ran out 3 min ago" in page and "stopped heartbeating" in page
    assert page.count("<progress") == 1  # the healthy job's bar only

    content = text_of(admin_client.get(detail(stuck)))
    assert '<strong class="pgjobs-status stuck">stuck</strong>' in content
    assert "Its worker (lost-worker) stopped heartbeating: its lease ran out 3 min ago." in content
    assert "takes the job back at its next reap" in content
    assert "No report since its worker stopped heartbeating." in content
    assert '<strong class="pgjobs-status stuck">' not in text_of(admin_client.get(detail(healthy)))


def test_stuck_is_judged_by_the_databases_clock_not_the_apps(admin_client, monkeypatch):
    stuck = stuck_job()
    JobFactory(running=True)  # leased for five more minutes
    real_now = timezone.now
    # An app whose clock is an hour fast would think both leases ran out; one slow, neither.
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    assert text_of(admin_client.get(JOBS)).count('class="pgjobs-status stuck"') == 1
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(hours=1))
    assert '<strong class="pgjobs-status stuck">' in text_of(admin_client.get(detail(stuck)))


def test_the_status_filter_finds_stuck_jobs_only(admin_client):
    stuck = stuck_job()
    JobFactory(running=True)
    JobFactory()
    JobFactory(dead=True)
    assert listed(admin_client, {"status__exact": "stuck"}) == [stuck.pk]
    assert len(listed(admin_client, {"status__exact": "running"})) == 2
    choices = text_of(admin_client.get(JOBS))
    assert "?status__exact=stuck" in choices and "stuck (lease ran out)" in choices


def test_a_dependency_that_is_stuck_shows_as_stuck_on_the_waiting_jobs_page(admin_client):
    stuck = stuck_job()
    waiting = JobFactory(status=Status.WAITING)
    Dependency.objects.create(job=waiting, after_job=stuck)
    content = text_of(admin_client.get(detail(waiting)))
    assert '<span class="pgjobs-wait-status">stuck</span>' in content


# Committed, so that the table is truncated afterwards (as the search plans' test).
@pytest.mark.django_db(transaction=True)
def test_the_stuck_and_worker_filters_read_the_running_jobs_index(admin_client):
    fill(20_000)
    stuck_job(worker="w9")
    for query in ({"status__exact": "stuck"}, {"worker": "w9"}):
        with CaptureQueriesContext(connection) as queries:
            assert admin_client.get(JOBS, query).status_code == 200
        sqls = [q["sql"] for q in queries if 'FROM "pgjobs_job"' in q["sql"]]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            for sql in sqls:
                cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
                plan = str(cursor.fetchone()[0])
                assert "Seq Scan" not in plan and "pgjobs_job_running_idx" in plan, (query, plan)


# ---- where the time went, and the worker's other jobs -----------------------------------------


def test_the_job_page_says_how_long_the_job_waited_ran_and_retried(admin_client):
    created = datetime(2026, 3, 2, 9, 0, 0, tzinfo=UTC)
    failed = created + timedelta(minutes=1)  # attempt 2 failed then: a 30 s backoff followed
    job = JobFactory(
        succeeded=True, attempts=3, created_at=created, run_at=failed + timedelta(seconds=30),
        started_at=failed + timedelta(seconds=40), finished_at=failed + timedelta(minutes=3),
        errors=[{"attempt": 2, "at": failed.isoformat(), "type": "RuntimeError"}],
    )  # fmt: skip
    content = text_of(admin_client.get(detail(job)))
    assert "<strong>waited</strong> 10 s from due to started" in content
    assert "<strong>ran</strong> 2 min" in content
    assert "<strong>retried</strong> 2 times; a backoff of 30 s after the last" in content
    assert "<strong>in all</strong> 4 min" in content
    retrying = text_of(admin_client.get(detail(JobFactory(retrying=True))))
    assert "<strong>waited</strong> not due yet: due in" in retrying
    assert "<strong>retried</strong> 1 time; a backoff of" in retrying


def test_the_job_page_links_its_worker_to_the_jobs_it_holds(admin_client):
    mine = JobFactory(running=True, worker="host:7:ab")
    JobFactory(succeeded=True, worker="host:7:ab")  # held no more
    JobFactory(running=True, worker="host:8:cd")
    link = f"{JOBS}?{urlencode({'worker': 'host:7:ab'})}"
    assert f'href="{link}"' in admin_client.get(detail(mine)).content.decode()
    response = admin_client.get(link)
    assert [job.pk for job in response.context["cl"].result_list] == [mine.pk]


# ---- where an action from the job's page leads ------------------------------------------------


def test_run_now_from_the_jobs_page_confirms_there_and_comes_back_with_the_lists_filters(
    admin_client,
):
    job = JobFactory(future=True)
    page = f"{detail(job)}?{urlencode({'_changelist_filters': 'status__exact=ready'})}"
    confirm = admin_client.post(page, {"action": "run_now"})
    assert confirm.context["cancel_url"] == page
    response = admin_client.post(page, {"action": "run_now", "post": "yes"}, follow=True)
    assert response.redirect_chain == [(page, 302)]
    assert messages_of(response) == ["1 job made due now."]
    assert reload(job).run_at <= timezone.now()


def test_replaying_a_dead_letter_from_its_page_leads_to_the_jobs_page_under_jobs(admin_client):
    job = JobFactory(dead=True)
    page = detail(job, "deadletter")
    response = admin_client.post(page, {"action": "replay", "post": "yes"}, follow=True)
    assert response.redirect_chain == [(detail(job), 302)]
    assert reload(job).status == Status.READY


def test_an_action_from_the_jobs_page_needs_its_permission():
    job = JobFactory()
    response = staff("view_job", "replay_job").post(detail(job), {"action": "cancel", "post": "1"})
    assert response.status_code == 403
    assert reload(job).status == Status.READY


# ---- a replay into a NATS stream ---------------------------------------------------------------


@pytest.fixture
def nats_queue(settings: Any) -> str:
    settings.PGJOBS = {**settings.PGJOBS, "QUEUES": {"events": {"TRANSPORT": "nats"}}}
    return "events"


def test_replaying_a_job_of_a_nats_queue_says_it_went_to_the_stream(admin_client, nats_queue):
    jobs = JobFactory.create_batch(2, dead=True, queue=nats_queue)
    response = act(admin_client, DEAD, "replay", [*jobs, JobFactory(dead=True)])
    assert messages_of(response) == [
        "3 jobs replayed. 2 went to NATS JetStream (PGJOBS_events): their rows leave the job "
        "table once relayed."
    ]


def test_replaying_a_nats_job_from_its_page_leads_to_the_list_not_a_page_the_relay_deletes(
    admin_client, nats_queue
):
    job = JobFactory(dead=True, queue=nats_queue)
    page = f"{detail(job)}?{urlencode({'_changelist_filters': 'queue=events'})}"
    response = admin_client.post(page, {"action": "replay", "post": "yes"})
    assert response["Location"] == f"{JOBS}?queue=events"
    Job.objects.relay([nats_queue], limit=10, publish=lambda jobs: None)
    after = admin_client.get(response["Location"])
    assert messages_of(after) == [
        "1 job replayed. 1 went to NATS JetStream (PGJOBS_events): its row leaves the job table "
        "once relayed."
    ]


# ---- the error history after a replay ----------------------------------------------------------


def test_the_history_says_that_earlier_entries_are_not_kept_once_a_replay_trimmed_it(
    admin_client,
):
    errors = [
        {"attempt": n, "at": f"2026-03-02T09:0{n}:00+00:00", "type": "RuntimeError"}
        for n in range(1, 6)
    ]
    job = JobFactory(dead=True, attempts=5, max_attempts=5, errors=errors)
    JobFactory(dead=True, errors=errors[:2])
    act(admin_client, DEAD, "replay", [job])
    assert [e.get("attempt") for e in reload(job).errors] == [2, 3, 4, 5, None]
    content = text_of(admin_client.get(detail(job)))
    assert (
        'The history keeps only its last 5 entries (PGJOBS["ERRORS_KEPT"]), and each replay '
        "adds one: any earlier ones are not kept."
    ) in content
    assert "attempts count from 1 again" in content
    short = Job.objects.exclude(pk=job.pk).get()
    assert "any earlier ones are not kept" not in text_of(admin_client.get(detail(short)))
