"""Batches and dependencies in the admin, through Django's test client: the Batches list and a
batch's page (its jobs counted by status, its callbacks, Replay failed members), the job page's
batch and dependencies, and the Jobs list's waiting and batch filters."""

from __future__ import annotations

import html
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import django_pgjobs
from django_pgjobs.admin import members
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import plans, tasks
from tests.factories import JobFactory
from tests.integration.test_admin import JOBS, Elements, detail, log_for, messages_of, staff

pytestmark = pytest.mark.django_db

BATCHES = reverse("admin:pgjobs_batch_changelist")


def page_of(batch: Batch | Any) -> str:
    return reverse("admin:pgjobs_batch_change", args=[batch.id])


def replay_failed(batch: Batch | Any) -> str:
    return reverse("admin:pgjobs_batch_replay_failed", args=[batch.id])


def reload(job: Job) -> Job:
    return Job.objects.get(pk=job.pk)


def an_export() -> tuple[Any, dict[str, Job]]:
    """A batch as a run left it: one job succeeded, one dead letter, one cancelled, one still
    ready (due in an hour); and on_complete and on_success, neither enqueued yet."""
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="x") as b:
        jobs = {
            "succeeded": tasks.part.enqueue(n=1),
            "failed": tasks.part.enqueue(n=2, fail=True),
            "cancelled": tasks.part.enqueue(n=3),
            "ready": tasks.part.using(delay=3600).enqueue(n=4),
        }
    Job.objects.filter(pk=jobs["cancelled"].pk).cancel()
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert {status: reload(job).status for status, job in jobs.items()} == {
        status: status for status in jobs
    }
    return b, jobs


def a_batch_of(*states: dict[str, Any], **batch: Any) -> Batch:
    """A batch row with one job per `states` (JobFactory's traits), written as batch() would."""
    made = Batch.objects.create(size=len(states), **batch)
    for state in states:
        JobFactory(batch=made, **state)
    return made


# ---- the Batches list ---------------------------------------------------------------------------


def test_the_batches_list_shows_each_batchs_size_progress_and_times_newest_first(admin_client):
    succeeded = a_batch_of({"succeeded": True}, {"succeeded": True})
    Batch.objects.filter(pk=succeeded.pk).update(
        completed_at="2026-03-02T09:00:00Z", succeeded_at="2026-03-02T09:00:00Z", succeeded=2
    )
    half = a_batch_of({"succeeded": True}, {"dead": True}, {"running": True}, {})
    response = admin_client.get(BATCHES)
    assert [b.pk for b in response.context["cl"].result_list] == [half.pk, succeeded.pk]
    content = response.content.decode()
    assert '<progress class="pgjobs-progress-bar" value="50" max="100">50%</progress>' in content
    assert '<progress class="pgjobs-progress-bar" value="100" max="100">100%</progress>' in content
    assert 'title="2 of 4"' in content and 'title="2 of 2"' in content
    assert half.short_id in content and succeeded.short_id in content


def test_a_completed_batch_that_did_not_succeed_says_how_many_failed(admin_client):
    b, jobs = an_export()
    Job.objects.filter(pk=jobs["ready"].pk).run_now()
    run_jobs(queues=["batches"], tasks=[tasks.part])  # the last one: the batch completes
    content = html.unescape(admin_client.get(BATCHES).content.decode())
    assert 'title="4 of 4: completed with 1 failed, 1 cancelled"' in content
    assert admin_client.get(BATCHES, {"state": "completed"}).context["cl"].result_count == 1
    assert admin_client.get(BATCHES, {"state": "open"}).context["cl"].result_count == 0
    page = html.unescape(admin_client.get(page_of(b)).content.decode())
    assert "completed, not succeeded: 1 failed and 1 cancelled of 4" in page


def test_the_batches_list_counts_its_pages_jobs_in_one_statement(admin_client):
    def queries_for_list() -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            admin_client.get(BATCHES)
        return [q["sql"] for q in queries]

    for _ in range(2):
        a_batch_of({}, {"running": True}, {"succeeded": True})
    few = queries_for_list()
    for _ in range(18):
        a_batch_of({}, {"running": True}, {"succeeded": True})
    many = queries_for_list()
    assert len(many) == len(few)
    assert sum("FROM pgjobs_job" in sql for sql in many) == 1  # the members' counts


def test_the_batches_list_finds_a_batch_by_its_id_and_nothing_else(admin_client):
    wanted, other = a_batch_of({}), a_batch_of({})
    found = admin_client.get(BATCHES, {"q": str(wanted.pk)}).context["cl"].result_list
    assert [b.pk for b in found] == [wanted.pk]
    assert list(admin_client.get(BATCHES, {"q": "export"}).context["cl"].result_list) == []
    assert other.pk != wanted.pk


# ---- a batch's page -----------------------------------------------------------------------------


def test_the_batch_page_counts_its_jobs_by_status_each_a_link_to_them_in_jobs(admin_client):
    b, jobs = an_export()
    response = admin_client.get(page_of(b))
    assert response.status_code == 200
    content = response.content.decode()
    for status in ("succeeded", "failed", "cancelled", "ready"):
        url = members.jobs_url(b.id, status)
        assert f'<a href="{html.escape(url)}">1</a>' in content, status
        listed = admin_client.get(url).context["cl"].result_list
        assert [job.pk for job in listed] == [jobs[status].pk]
    assert '<td class="count">0</td>' in content  # waiting, running: no link
    assert "1 of 4 (25%)" not in content and "3 of 4 (75%)" in content  # the progress
    listed = admin_client.get(members.jobs_url(b.id)).context["cl"].result_list
    assert {job.pk for job in listed} == {job.pk for job in jobs.values()}
    assert response.context["adminform"].form.fields == {}  # nothing editable
    assert 'name="_save"' not in content


def test_the_batch_page_counts_jobs_that_are_gone_and_estimates_past_the_limit(
    admin_client, monkeypatch
):
    b = a_batch_of({"succeeded": True}, {"succeeded": True}, {"succeeded": True}, {})
    Batch.objects.filter(pk=b.pk).update(size=6)  # two of its jobs pruned since
    content = admin_client.get(page_of(b)).content.decode()
    assert 'pruned or deleted</td><td class="count">2</td>' in content

    monkeypatch.setattr(members, "EXACT_COUNT_LIMIT", 2)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
    counted = members.count([b])[b.pk]
    assert counted[Status.SUCCEEDED].estimated and counted[Status.SUCCEEDED].n >= 3
    assert counted[Status.READY] == members.Count(1)
    content = admin_client.get(page_of(b)).content.decode()

    def row(status: str) -> str:
        return content.split(f'<tr class="pgjobs-members-{status}">')[1].split("</tr>")[0]

    assert f"about {counted[Status.SUCCEEDED].n}</a>" in row("succeeded")
    assert ">1</a>" in row("ready") and "about" not in row("ready")
    assert "pruned or deleted" not in content  # not told when the counts are estimates


def test_each_count_is_a_range_of_the_batch_index_not_a_read_of_the_whole_batch():
    b = a_batch_of(*[{"succeeded": True}] * 50)
    for _ in range(20):
        a_batch_of(*[{"succeeded": True}] * 40, *[{"dead": True}] * 10)
    JobFactory.create_batch(500)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
    statement = members.counts_sql(1, members.ORDER)
    plan = plans.explain(statement, {"batch_0": b.pk, "most": members.EXACT_COUNT_LIMIT + 1})
    reads = [node for node in plans.nodes(plan) if node.get("Relation Name") == "pgjobs_job"]
    assert len(reads) == len(members.ORDER), plans.shown(plan)
    for node in reads:
        assert node["Node Type"] != "Seq Scan", plans.shown(plan)
        assert not node["Index Name"].startswith("pgjobs_job_batch_id_"), plans.shown(plan)
    ended = [n for n in reads if "'succeeded'" in n.get("Index Cond", "") + n.get("Filter", "")]
    assert [n["Index Name"] for n in ended] == ["pgjobs_job_batch_idx"], plans.shown(plan)


def test_the_batch_page_shows_its_callbacks_and_links_their_jobs_once_enqueued(admin_client):
    b, jobs = an_export()
    content = html.unescape(admin_client.get(page_of(b)).content.decode())
    assert "<code>tests.tasks.batch_done</code>: enqueued once every job has finished" in content
    assert "<code>tests.tasks.mail</code>: enqueued once every job has succeeded" in content

    Job.objects.filter(pk=jobs["ready"].pk).run_now()
    run_jobs(queues=["batches"], tasks=[tasks.part])  # it completes: on_complete is enqueued
    callback = Job.objects.get(task=tasks.batch_done.name)
    assert str(callback.pk) == Batch.objects.get(pk=b.id).on_complete["id"]
    content = html.unescape(admin_client.get(page_of(b)).content.decode())
    assert f'<a href="{detail(callback)}">{callback.short_id}</a> (ready)' in content
    assert "<code>tests.tasks.mail</code>: enqueued once every job has succeeded" in content

    callback.delete()  # pruned
    content = html.unescape(admin_client.get(page_of(b)).content.decode())
    assert "<code>tests.tasks.batch_done</code>: enqueued, since pruned or deleted" in content


def test_a_batch_page_quotes_what_its_row_holds_escaped(admin_client):
    b = a_batch_of(
        {"task": "<xss-task>"},
        on_complete={"task": "<xss-callback>", "id": "<xss-id>"},
        on_success=["<xss-list>"],
    )
    for url in (BATCHES, page_of(b), detail(Job.objects.get(batch=b))):
        response = admin_client.get(url)
        assert response.status_code == 200
        parsed = Elements()
        parsed.feed(response.content.decode())
        assert not [tag for tag in parsed.tags if tag.startswith("xss-")], url
    content = admin_client.get(page_of(b)).content.decode()
    assert "&lt;xss-callback&gt;" in content and "&lt;xss-list&gt;" in content


# ---- replay failed members ---------------------------------------------------------------------


def test_replay_failed_members_asks_then_replays_the_failed_and_cancelled_ones_and_logs_them(
    admin_client, admin_user
):
    b, jobs = an_export()
    other = a_batch_of({"dead": True})
    page = admin_client.get(page_of(b))
    assert page.context["replay_failed_url"] == replay_failed(b)
    assert "Replay failed members…" in page.content.decode()

    confirm = admin_client.get(replay_failed(b))
    assert confirm.templates[0].name == "admin/pgjobs/confirm_action.html"
    assert confirm.context["count"] == 2
    assert confirm.context["cancel_url"] == page_of(b)
    assert reload(jobs["failed"]).status == Status.FAILED  # asking changed nothing

    response = admin_client.post(replay_failed(b), {"post": "yes"}, follow=True)
    assert messages_of(response) == ["2 jobs replayed."]
    assert response.redirect_chain[-1][0] == page_of(b)
    assert reload(jobs["failed"]).status == Status.READY
    assert reload(jobs["cancelled"]).status == Status.READY
    assert reload(jobs["succeeded"]).status == Status.SUCCEEDED
    assert Job.objects.get(batch=other).status == Status.FAILED  # another batch's
    for name in ("failed", "cancelled"):
        assert log_for(jobs[name]) == [(admin_user.username, CHANGE, "Replayed.")]
        assert reload(jobs[name]).errors[-1]["by"] == admin_user.username
    assert "replay_failed_url" not in admin_client.get(page_of(b)).context  # none left


def test_replay_failed_members_takes_the_replay_queue_option(admin_client):
    b, jobs = an_export()
    admin_client.post(replay_failed(b), {"post": "yes", "queue": "emails"})
    assert {reload(jobs[n]).queue for n in ("failed", "cancelled")} == {"emails"}
    assert log_for(jobs["failed"])[0][2] == "Replayed into queue emails."


@pytest.mark.django_db(transaction=True)
def test_the_replayed_members_success_makes_the_batch_succeed_and_call_on_success(admin_client):
    with django_pgjobs.batch(on_success=tasks.mail, name="y") as b:
        tasks.part.enqueue(n=1)
        failing = tasks.part.enqueue(n=2, fail=True)
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert Batch.objects.get(pk=b.id).completed_at is not None
    Job.objects.filter(pk=failing.pk).replace_payload({"n": 2})
    admin_client.post(replay_failed(b), {"post": "yes"})
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert Batch.objects.get(pk=b.id).succeeded_at is not None
    assert Job.objects.filter(task=tasks.mail.name).count() == 1
    content = admin_client.get(page_of(b)).content.decode()
    assert ">succeeded</div>" in content or "succeeded" in content
    assert "replay_failed_url" not in admin_client.get(page_of(b)).context


def test_a_view_only_user_sees_batches_but_may_not_replay_them_even_by_a_forged_post():
    b, jobs = an_export()
    for viewer in (staff("view_job"), staff("view_job", "cancel_job")):
        assert viewer.get(BATCHES).status_code == 200
        page = viewer.get(page_of(b))
        assert page.status_code == 200
        assert "replay_failed_url" not in page.context
        assert "Replay failed members" not in page.content.decode()
        assert viewer.get(replay_failed(b)).status_code == 403
        assert viewer.post(replay_failed(b), {"post": "yes"}).status_code == 403
        assert viewer.post(page_of(b), {"size": "9"}).status_code == 403
    assert reload(jobs["failed"]).status == Status.FAILED
    assert reload(jobs["cancelled"]).status == Status.CANCELLED
    assert Batch.objects.get(pk=b.id).size == 4
    assert not LogEntry.objects.exists()


def test_the_batches_answer_with_the_job_permissions():
    b = a_batch_of({})
    assert staff("view_batch").get(BATCHES).status_code == 403
    replayer = staff("view_job", "replay_job")
    assert replayer.get(page_of(b)).status_code == 200
    assert replayer.get(reverse("admin:pgjobs_batch_add")).status_code == 403
    assert replayer.get(reverse("admin:pgjobs_batch_delete", args=[b.pk])).status_code == 403


# ---- the job's page -----------------------------------------------------------------------------


def test_a_members_page_links_its_batch(admin_client):
    b, jobs = an_export()
    page = admin_client.get(detail(jobs["failed"]))
    content = html.unescape(page.content.decode())
    assert (
        f'<a href="{page_of(b)}">batch {Batch.objects.get(pk=b.id).short_id}</a> (open)' in content
    )
    assert "Batch and dependencies" in content


def test_a_callbacks_page_links_the_batch_it_is_a_callback_of(admin_client):
    with django_pgjobs.batch(on_complete=tasks.batch_done) as b:
        pass  # empty: its callback at once
    callback = Job.objects.get(task=tasks.batch_done.name)
    content = html.unescape(admin_client.get(detail(callback)).content.decode())
    short_id = Batch.objects.get(pk=b.id).short_id
    assert f'on_complete callback of <a href="{page_of(b)}">batch {short_id}</a>' in content


def test_a_jobs_page_shows_what_it_waits_for_each_with_its_status_and_which_one_failed(
    admin_client,
):
    a = tasks.step.enqueue(name="a", fail=True)
    ok = tasks.step.enqueue(name="ok")
    with django_pgjobs.batch() as b:
        tasks.part.enqueue(n=1)
    c = tasks.step.using(after=[ok, a, b]).enqueue(name="c")
    waiting = admin_client.get(detail(c))
    content = html.unescape(waiting.content.decode())
    assert [name for name, _ in waiting.context["job_actions"]] == ["cancel"]
    assert f'job <a href="{detail(a)}">tests.tasks.step [{a.short_id}]</a>: ' in content
    short_id = Batch.objects.get(pk=b.id).short_id
    assert (
        f'batch <a href="{page_of(b)}">{short_id}</a>: <span class="pgjobs-wait-status">open'
        in (content)
    )
    assert "it cancelled this job" not in content

    run_jobs(queues=["batches"])
    assert reload(c).status == Status.CANCELLED
    content = html.unescape(admin_client.get(detail(c)).content.decode())
    failed = content.split('class="pgjobs-wait pgjobs-wait-failed"')
    assert len(failed) == 2 and failed[1].startswith(f'>job <a href="{detail(a)}">')
    assert "failed: it cancelled this job" in failed[1].split("</li>")[0]
    assert f'{ok.short_id}]</a>: <span class="pgjobs-wait-status">succeeded' in content
    assert "DependencyFailed: job" in content  # its last error says why


def test_a_jobs_page_lists_at_most_so_many_dependencies_and_says_how_many_more(
    admin_client, monkeypatch
):
    from django_pgjobs.admin import waits

    monkeypatch.setattr(waits, "DEPENDENCIES_SHOWN", 2)
    before = [tasks.step.enqueue(name=str(n)) for n in range(5)]
    job = tasks.step.using(after=before).enqueue(name="after")
    Job.objects.filter(pk=before[0].pk).delete()
    content = html.unescape(admin_client.get(detail(job)).content.decode())
    assert content.count('class="pgjobs-wait"') == 2
    assert "and 3 more" in content
    assert f'job {before[0].pk}: <span class="pgjobs-wait-status">deleted or pruned' in content


def test_a_job_outside_batches_and_dependencies_has_no_such_fields(admin_client):
    content = admin_client.get(detail(JobFactory())).content.decode()
    assert "Batch and dependencies" not in content


# ---- the Jobs list ------------------------------------------------------------------------------


def test_the_jobs_list_filters_waiting_jobs_and_jobs_in_a_batch(admin_client):
    first = tasks.step.enqueue(name="first")
    waiting = tasks.step.using(after=[first]).enqueue(name="second")
    b = a_batch_of({"dead": True})
    member = Job.objects.get(batch=b)
    a_batch_of({})

    def listed(query: dict[str, str]) -> list[Any]:
        return [job.pk for job in admin_client.get(JOBS, query).context["cl"].result_list]

    response = admin_client.get(JOBS)
    specs = {spec.title: spec for spec in response.context["cl"].filter_specs}
    status_choices = [c["display"] for c in specs["status"].choices(response.context["cl"])]
    assert "waiting" in status_choices
    batch_choices = [c["display"] for c in specs["batch"].choices(response.context["cl"])]
    assert batch_choices == ["All", "In a batch"]

    assert listed({"status__exact": "waiting"}) == [waiting.pk]
    assert len(listed({"batch": "any"})) == 2
    assert listed({"batch": str(b.pk)}) == [member.pk]
    assert listed({"batch": str(b.pk), "status__exact": "failed"}) == [member.pk]
    assert listed({"batch": str(b.pk), "status__exact": "ready"}) == []
    filtered = admin_client.get(JOBS, {"batch": str(b.pk)})
    specs = {spec.title: spec for spec in filtered.context["cl"].filter_specs}
    shown = [c["display"] for c in specs["batch"].choices(filtered.context["cl"])]
    assert shown == ["All", "In a batch", f"batch {b.short_id}"]


def test_a_batch_filter_that_is_not_an_id_is_an_incorrect_lookup(admin_client):
    response = admin_client.get(JOBS, {"batch": "nonsense"})
    assert (response.status_code, response["Location"]) == (302, f"{JOBS}?e=1")


def test_the_jobs_list_of_a_batchs_failed_members_offers_replay_all_matching(admin_client):
    b = a_batch_of({"dead": True})
    response = admin_client.get(members.jobs_url(b, Status.FAILED))
    assert "replay_matching_url" in response.context
    assert f"batch={b.pk}" in response.context["replay_matching_url"]


@pytest.mark.parametrize("table", ["pgjobs_batch", "pgjobs_job"])
@pytest.mark.parametrize("page", ["list", "batch"])
def test_a_batch_page_whose_table_is_missing_says_to_run_migrate(admin_client, table, page):
    b = a_batch_of({})
    url = BATCHES if page == "list" else page_of(b)
    with connection.cursor() as cursor:  # as if migrate had not run (undone with the test)
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_elsewhere")
    response = admin_client.get(url)
    assert response.status_code == 503
    assert "<pre>python manage.py migrate</pre>" in html.unescape(response.content.decode())
