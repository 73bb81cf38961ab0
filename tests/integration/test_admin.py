"""The admin through Django's test client: lists, detail page, audited actions, permissions."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.models import QuerySet
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_pgjobs.admin import actions as admin_actions
from django_pgjobs.admin import lists as admin_lists
from django_pgjobs.models import Job, Queue
from django_pgjobs.status import Status
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db

JOBS = reverse("admin:pgjobs_job_changelist")
DEAD = reverse("admin:pgjobs_deadletter_changelist")
REPLAY_MATCHING = reverse("admin:pgjobs_deadletter_replay_matching")


def detail(job: Job, model: str = "job") -> str:
    return reverse(f"admin:pgjobs_{model}_change", args=[job.pk])


def staff(*codenames: str) -> Client:
    user = User.objects.create_user(f"staff-{'-'.join(codenames)}", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="pgjobs", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def act(
    client: Client, url: str, action: str, jobs: Iterable[Job], confirm: bool = True, **extra: Any
) -> Any:
    """Post an action as the changelist does; with `confirm`, also the confirmation page."""
    data = {"action": action, "_selected_action": [str(job.pk) for job in jobs], **extra}
    if confirm:
        data["post"] = "yes"
    return client.post(url, data, follow=True)


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def summary_of(response: Any, part: str = "summary") -> list[tuple[str, str, int]]:
    """The dead letters' summary groups the page shows (or the rest, under its toggle)."""
    return [(g["task"], g["error_type"], g["jobs"]) for g in response.context[part]]


def reload(job: Job) -> Job:
    return Job.objects.get(pk=job.pk)


def log_for(job: Job) -> list[tuple[str, int, str]]:
    entries = LogEntry.objects.filter(object_id=str(job.pk)).select_related("user")
    return [(entry.user.username, entry.action_flag, entry.change_message) for entry in entries]


# ---- lists ---------------------------------------------------------------------------------


def test_jobs_changelist_lists_newest_first_with_the_first_line_of_the_last_error(admin_client):
    older = JobFactory(dead=True, last_error="RuntimeError: boom\nsecond line")
    newer = JobFactory(task="tests.tasks.send_email", queue="emails")
    response = admin_client.get(JOBS)
    assert [job.pk for job in response.context["cl"].result_list] == [newer.pk, older.pk]
    content = response.content.decode()
    assert "RuntimeError: boom" in content and "second line" not in content
    assert older.short_id in content and "0/3" in content


def test_changelist_filters_by_status_queue_and_task(admin_client):
    ready = JobFactory(queue="emails")
    dead = JobFactory(dead=True, task="tests.tasks.always_fails")

    def listed(query: str) -> list[Any]:
        return [job.pk for job in admin_client.get(JOBS + query).context["cl"].result_list]

    assert listed("?status__exact=failed") == [dead.pk]
    assert listed("?queue=emails") == [ready.pk]
    assert listed("?task=tests.tasks.always_fails") == [dead.pk]
    assert listed("?task=not.registered.anywhere") == []


def test_search_finds_a_job_by_full_id_short_id_task_and_unique_key(admin_client):
    job = JobFactory(task="tests.tasks.send_email", unique_key="order-42")
    JobFactory()
    for term in (str(job.pk), job.short_id, "send_email", "order-42"):
        result = admin_client.get(JOBS, {"q": term}).context["cl"].result_list
        assert [found.pk for found in result] == [job.pk], term


def test_dead_letters_list_only_failed_jobs_with_a_summary_by_task_and_error_type(admin_client):
    dead = JobFactory.create_batch(2, dead=True, last_error="RuntimeError: boom")
    other = JobFactory(dead=True, task="tests.tasks.always_fails", last_error="KeyError: 'x'")
    JobFactory()
    JobFactory(succeeded=True)
    response = admin_client.get(DEAD)
    assert {job.pk for job in response.context["cl"].result_list} == {
        *(j.pk for j in dead),
        other.pk,
    }
    assert summary_of(response) == [
        ("tests.tasks.noop", "RuntimeError", 2),
        ("tests.tasks.always_fails", "KeyError", 1),
    ]
    filtered = admin_client.get(DEAD, {"error_type": "KeyError"}).context["cl"].result_list
    assert [job.pk for job in filtered] == [other.pk]


def test_the_summary_and_the_error_types_read_the_newest_dead_letters_only(
    admin_client, monkeypatch
):
    # Both read every dead letter, each page: 1.3-1.7 s at a million (attack 23, F6)
    from django_pgjobs.admin import jobs, lists

    monkeypatch.setattr(lists, "NEWEST", 3)
    monkeypatch.setattr(jobs, "NEWEST", 3)
    JobFactory.create_batch(2, dead=True, last_error="KeyError: 'x'")  # the oldest
    JobFactory.create_batch(3, dead=True, last_error="RuntimeError: boom")
    response = admin_client.get(DEAD)
    assert summary_of(response) == [("tests.tasks.noop", "RuntimeError", 3)]
    assert "Dead letters by task and error type (the newest 3)" in response.content.decode()
    error_types = [
        f for f in response.context["cl"].filter_specs if f.parameter_name == "error_type"
    ]
    assert [value for value, _ in error_types[0].lookup_choices] == ["RuntimeError"]


def test_the_summary_shows_a_new_error_type_and_says_how_many_groups_it_leaves_out(admin_client):
    # It showed the 20 largest groups, without saying there were more: an error that had just
    # appeared, with one job, was hidden under older, larger ones.
    an_hour_ago = timezone.now() - timedelta(hours=1)
    for n in range(10):
        JobFactory.create_batch(3, dead=True, last_error=f"Big{n}: boom")
    for n in range(11):  # Old9 and Old10 failed first
        finished = an_hour_ago - timedelta(minutes=n)
        JobFactory.create_batch(2, dead=True, last_error=f"Old{n}: boom", finished_at=finished)
    JobFactory(dead=True, last_error="NewError: boom")
    response = admin_client.get(DEAD)
    shown = [error_type for _task, error_type, _jobs in summary_of(response)]
    assert len(shown) == 20 and "NewError" in shown and {f"Big{n}" for n in range(10)} < set(shown)
    assert summary_of(response, "summary_rest") == [
        ("tests.tasks.noop", "Old10", 2), ("tests.tasks.noop", "Old9", 2),
    ]  # fmt: skip
    page = html.unescape(response.content.decode())
    assert (
        "<summary>20 of 22 groups shown (the largest, and those that failed last); the rest: "
        "4 jobs. Show them</summary>"
    ) in page
    toggled = page.split("<summary>20 of 22")[1].split("</details>")[0]
    assert toggled.count("error_type=Old") == 2


def test_the_changelist_never_counts_the_whole_table_nor_reads_payloads(admin_client):
    JobFactory.create_batch(3)
    with CaptureQueriesContext(connection) as queries:
        admin_client.get(JOBS)
    job_queries = [q["sql"] for q in queries if 'FROM "pgjobs_job"' in q["sql"]]
    assert job_queries
    for sql in job_queries:
        assert "COUNT(" not in sql.upper() or "LIMIT" in sql.upper(), sql
        assert '"pgjobs_job"."payload"' not in sql and '"pgjobs_job"."errors"' not in sql, sql


def test_the_changelist_makes_the_same_queries_for_2_jobs_as_for_20(admin_client):
    def queries_for_list() -> int:
        with CaptureQueriesContext(connection) as queries:
            admin_client.get(JOBS)
        return len(queries)

    JobFactory.create_batch(2)
    few = queries_for_list()
    JobFactory.create_batch(18)
    assert queries_for_list() == few


def test_past_the_exact_count_limit_the_changelist_shows_an_estimate(admin_client, monkeypatch):
    monkeypatch.setattr(admin_lists, "EXACT_COUNT_LIMIT", 3)
    JobFactory.create_batch(5)
    response = admin_client.get(JOBS)
    assert response.context["cl"].paginator.estimated is True
    assert "about" in response.content.decode()


def test_every_count_of_an_estimated_list_says_about_and_is_rounded(admin_client, monkeypatch):
    # Django's "40722 results" and "Select all 40722 jobs" read as exact (there were 49,820);
    # only the footer said "about".
    monkeypatch.setattr(admin_lists, "EXACT_COUNT_LIMIT", 3)
    plan = json.dumps([{"Plan": {"Plan Rows": 40722}}])
    monkeypatch.setattr(QuerySet, "explain", lambda self, **options: plan)
    JobFactory.create_batch(5)
    page = html.unescape(admin_client.get(JOBS).content.decode())
    assert "about 41,000 results (" in page  # beside the search box
    assert "Select all of about 41,000 jobs" in page and "All of about 41,000 selected" in page
    assert "about 41,000</span>\njobs" in page  # the footer
    assert "40722" not in page and "40,722" not in page


# ---- detail ---------------------------------------------------------------------------------


def test_the_detail_page_is_read_only_with_pretty_payload_and_error_timeline(admin_client):
    job = JobFactory(
        dead=True,
        task="custom.name",
        payload={"password": "hunter2", "user_id": 7},
        errors=[
            {"attempt": 1, "at": "2026-01-01T00:00:00Z", "worker": "host:1", "type": "KeyError",
             "message": "'x'", "traceback": "Traceback (most recent call last):\n  boom"},
        ],
    )  # fmt: skip
    response = admin_client.get(detail(job))
    content = html.unescape(response.content.decode())
    assert response.context["adminform"].form.fields == {}  # nothing editable
    assert '"user_id": 7' in content  # pretty-printed JSON
    assert "hunter2" not in content and "[redacted]" in content  # the task's redact hook
    assert "host:1" in content and "<details>" in content and "most recent call last" in content
    assert 'name="_save"' not in content


def test_the_detail_page_offers_the_actions_that_apply_to_the_job(admin_client):
    dead, ready = JobFactory(dead=True), JobFactory(future=True)
    assert [n for n, _ in admin_client.get(detail(dead)).context["job_actions"]] == ["replay"]
    offered = [n for n, _ in admin_client.get(detail(ready)).context["job_actions"]]
    assert offered == ["run_now", "cancel"]
    viewer = staff("view_job")
    assert viewer.get(detail(dead)).context["job_actions"] == []


# ---- actions --------------------------------------------------------------------------------


def test_replay_asks_for_confirmation_with_the_count_then_replays(admin_client, admin_user):
    jobs = JobFactory.create_batch(2, dead=True)
    page = act(admin_client, DEAD, "replay", jobs, confirm=False)
    assert page.templates[0].name == "admin/pgjobs/confirm_action.html"
    assert page.context["count"] == 2
    assert [reload(job).status for job in jobs] == [Status.FAILED] * 2

    response = act(admin_client, DEAD, "replay", jobs)
    assert messages_of(response) == ["2 jobs replayed."]
    for job in jobs:
        row = reload(job)
        assert (row.status, row.attempts, row.finished_at) == (Status.READY, 0, None)
        assert log_for(job) == [(admin_user.username, CHANGE, "Replayed.")]


def test_replay_into_another_queue(admin_client):
    job = JobFactory(dead=True)
    response = act(admin_client, DEAD, "replay", [job], queue="emails")
    assert messages_of(response) == ["1 job replayed."]
    assert (reload(job).status, reload(job).queue) == (Status.READY, "emails")
    assert log_for(job)[0][2] == "Replayed into queue emails."


def test_replay_refuses_a_malformed_queue_name_and_changes_nothing(admin_client):
    job = JobFactory(dead=True)
    response = act(admin_client, DEAD, "replay", [job], queue="bad queue!")
    assert "not a valid queue name" in response.content.decode()
    assert reload(job).status == Status.FAILED and log_for(job) == []


def test_replay_skips_running_jobs_and_logs_only_the_replayed_ones(admin_client):
    dead, running = JobFactory(dead=True), JobFactory(running=True)
    response = act(admin_client, JOBS, "replay", [dead, running])
    assert messages_of(response) == [
        "1 job replayed. 1 skipped: only failed or cancelled jobs are replayed, and of a unique "
        "key only the oldest, while no live job holds it."
    ]
    assert reload(running).status == Status.RUNNING and log_for(running) == []
    assert reload(dead).status == Status.READY and len(log_for(dead)) == 1


def test_replaying_dead_letters_that_share_a_unique_key_replays_one_and_says_why_not_the_other(
    admin_client,
):
    older, newer = JobFactory(dead=True, unique_key="order-9"), JobFactory(dead=True)
    newer.unique_key = "order-9"
    newer.save(update_fields=["unique_key"])
    other = JobFactory(dead=True)
    response = act(admin_client, DEAD, "replay", [older, newer, other])
    assert response.status_code == 200
    assert messages_of(response) == [
        "2 jobs replayed. 1 skipped: only failed or cancelled jobs are replayed, and of a "
        "unique key only the oldest, while no live job holds it."
    ]
    assert (reload(older).status, reload(newer).status) == (Status.READY, Status.FAILED)


def test_run_now_makes_a_job_scheduled_for_later_due(admin_client, admin_user):
    job = JobFactory(future=True)
    response = act(admin_client, JOBS, "run_now", [job])
    assert messages_of(response) == ["1 job made due now."]
    assert Job.objects.due().filter(pk=job.pk).exists()
    assert log_for(job) == [(admin_user.username, CHANGE, "Run now.")]


def test_cancel_cancels_ready_jobs_and_asks_running_ones_to_stop(admin_client, admin_user):
    ready, running, done = JobFactory(), JobFactory(running=True), JobFactory(succeeded=True)
    page = act(admin_client, JOBS, "cancel", [ready, running, done], confirm=False)
    assert page.context["count"] == 3
    response = act(admin_client, JOBS, "cancel", [ready, running, done])
    assert messages_of(response) == [
        "2 jobs cancelled (running ones stop if their handler checks, else finish). "
        "1 skipped: only ready jobs, and running ones not asked to stop yet, are cancelled."
    ]
    running = reload(running)
    assert (reload(ready).status, running.status) == (Status.CANCELLED, Status.RUNNING)
    assert running.cancel_requested
    # Asked again: the reason given was "only ready and running jobs" (attack 23, F9)
    again = act(admin_client, JOBS, "cancel", [running])
    assert "running ones not asked to stop yet" in messages_of(again)[0]
    assert log_for(ready) == [(admin_user.username, CHANGE, "Cancelled.")]


def test_delete_removes_the_jobs_and_logs_each_deletion(admin_client, admin_user):
    jobs = JobFactory.create_batch(2, dead=True)
    page = act(admin_client, DEAD, "delete_jobs", jobs, confirm=False)
    assert page.context["count"] == 2
    response = act(admin_client, DEAD, "delete_jobs", jobs)
    assert messages_of(response) == ["2 jobs deleted."]
    assert not Job.objects.filter(pk__in=[job.pk for job in jobs]).exists()
    assert all(log_for(job) == [(admin_user.username, DELETION, "Deleted.")] for job in jobs)


def test_the_admin_log_names_the_job_under_the_job_model(admin_client):
    job = JobFactory(dead=True)
    act(admin_client, DEAD, "replay", [job])
    entry = LogEntry.objects.get(object_id=str(job.pk))
    assert entry.content_type == ContentType.objects.get_for_model(Job)
    assert entry.get_admin_url() == detail(job)


def test_replay_everything_matching_the_filter_without_selecting_rows(admin_client):
    failing = JobFactory.create_batch(3, dead=True, task="tests.tasks.always_fails")
    other = JobFactory(dead=True)
    changelist = admin_client.get(DEAD, {"task": "tests.tasks.always_fails"})
    url = changelist.context["replay_matching_url"]
    assert url == f"{REPLAY_MATCHING}?task=tests.tasks.always_fails"

    page = admin_client.get(url)
    assert page.context["count"] == 3
    response = admin_client.post(url, {"post": "yes"}, follow=True)
    assert messages_of(response) == ["3 jobs replayed."]
    assert response.redirect_chain[-1][0] == f"{DEAD}?task=tests.tasks.always_fails"
    assert {reload(job).status for job in failing} == {Status.READY}
    assert reload(other).status == Status.FAILED


def test_select_across_replays_every_job_matching_the_filter(admin_client, monkeypatch):
    monkeypatch.setattr(admin_actions, "ACTION_BATCH", 2)  # several batches
    jobs = JobFactory.create_batch(5, dead=True)
    response = act(admin_client, DEAD, "replay", jobs[:1], select_across="1")
    assert messages_of(response) == ["5 jobs replayed."]
    assert LogEntry.objects.count() == 5


# ---- permissions ----------------------------------------------------------------------------


def test_replay_all_matching_is_offered_where_the_list_shows_replayable_jobs(admin_client):
    assert "replay_matching_url" in admin_client.get(DEAD).context
    assert "replay_matching_url" not in admin_client.get(JOBS).context
    assert "replay_matching_url" in admin_client.get(JOBS, {"status__exact": "cancelled"}).context


def test_a_view_only_user_sees_the_jobs_but_no_actions():
    JobFactory(dead=True)
    viewer = staff("view_job")
    for url in (JOBS, DEAD):
        response = viewer.get(url)
        assert response.status_code == 200
        assert response.context["action_form"] is None
        assert "replay_matching_url" not in response.context


def test_a_forged_action_post_from_a_view_only_user_changes_nothing():
    job = JobFactory(dead=True)
    viewer = staff("view_job")
    for action in ("replay", "delete_jobs", "delete_selected"):
        act(viewer, DEAD, action, [job], index="0")
        act(viewer, DEAD, action, [job])
    assert viewer.post(REPLAY_MATCHING, {"post": "yes"}).status_code == 403
    assert viewer.post(detail(job), {"status": "ready"}).status_code == 403
    assert reload(job).status == Status.FAILED
    assert not LogEntry.objects.exists()


def test_each_action_is_offered_only_with_its_permission():
    JobFactory()
    cases = {
        ("view_job", "cancel_job"): ["cancel"],
        ("view_job", "replay_job"): ["replay", "run_now"],
        ("view_job", "delete_job"): ["delete_jobs"],
    }
    for codenames, offered in cases.items():
        choices = staff(*codenames).get(JOBS).context["action_form"].fields["action"].choices
        assert [name for name, _ in choices if name] == offered


def test_a_user_with_cancel_permission_cannot_replay():
    job = JobFactory(dead=True)
    act(staff("view_job", "cancel_job"), DEAD, "replay", [job])
    assert reload(job).status == Status.FAILED


# ---- escaping -------------------------------------------------------------------------------


class Elements(HTMLParser):
    """Every element and attribute in a page, and the text inside <script> elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attributes: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes.extend(name for name, _ in attrs)
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


def test_job_data_containing_markup_is_escaped_on_every_page(admin_client):
    job = JobFactory(
        dead=True,
        task="<xss-task data-xss=1>t</xss-task>",
        queue="<xss-queue>",
        unique_key="<xss-key>",
        payload={"<xss-payload-key>": "<script>xss()</script><img data-xss src=x>"},
        last_error="<xss-error>Boom: <script>xss()</script>",
        errors=[
            {"attempt": "<xss-attempt>", "at": "<xss-at>", "worker": "<xss-worker>",
             "type": "<xss-type>", "message": "<script>xss()</script>",
             "traceback": "</pre><xss-traceback>"},
        ],
    )  # fmt: skip
    pages = [
        admin_client.get(JOBS),
        admin_client.get(DEAD),
        admin_client.get(detail(job)),
        admin_client.get(detail(job, "deadletter")),
        act(admin_client, JOBS, "replay", [job], confirm=False),
    ]
    for response in pages:
        content = response.content.decode()
        assert response.status_code == 200
        assert "xss-task" in content  # the data is shown...
        parsed = Elements()
        parsed.feed(content)
        assert not [tag for tag in parsed.tags if tag.startswith("xss-")]  # ...never as markup
        assert "data-xss" not in parsed.attributes
        assert not [script for script in parsed.scripts if "xss" in script]


def test_the_detail_page_shows_the_kept_result_and_when_the_attempt_started(admin_client):
    JobFactory()
    (job,) = Job.objects.claim(["default"], worker="w1", limit=1)
    Job.objects.complete(job, '{"total": 42}')
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[job.pk]))
    content = page.content.decode()
    assert "&quot;total&quot;: 42" in content
    assert "Started at" in content


@pytest.mark.parametrize(
    ("table", "url"),
    [
        ("pgjobs_job", JOBS),
        ("pgjobs_job", DEAD),
        ("pgjobs_job", REPLAY_MATCHING),
        ("pgjobs_queue", reverse("admin:pgjobs_queue_changelist")),
        ("pgjobs_rollup", reverse("admin:pgjobs_queue_report")),
        ("pgjobs_schedule", reverse("admin:pgjobs_schedule_changelist")),
    ],
)
def test_a_page_whose_table_is_missing_says_to_run_migrate(table, url):
    client = staff("view_job", "replay_job", "view_queue", "view_schedule")
    with connection.cursor() as cursor:  # as if migrate had not run (undone with the test)
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_elsewhere")
    response = client.get(url)
    assert response.status_code == 503
    page = html.unescape(response.content.decode())
    assert (
        f'the pgjobs tables are missing or out of date (relation "{table}" does not exist): '
        "run `manage.py migrate`"
    ) in page
    assert "<pre>python manage.py migrate</pre>" in page


def test_a_statistics_row_that_cannot_be_read_costs_neither_replay_nor_the_report_page(
    admin_client,
):
    # A stray row (by hand, from a restored dump) made the report page and every Replay action
    # an HTTP 500 for as long as the row was recent; now it is left out of the rollup.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pgjobs_queuestat (seconds, worker, queue, claimed, succeeded, retried, "
            "failed, latency_buckets) VALUES ('NaN', 'w', 'default', 0, 0, 0, 0, '[]')"
        )
    job = JobFactory(dead=True)
    response = act(admin_client, DEAD, "replay", [job])
    assert messages_of(response) == ["1 job replayed."]
    response = admin_client.get(reverse("admin:pgjobs_queue_report"), follow=True)
    assert response.status_code == 200
    assert messages_of(response) == []


def test_a_queue_keeps_its_name_on_its_change_page(admin_client):
    # Renamed there, Django saved a copy under the new name and said "changed"; the old row
    # stayed, paused.
    Queue.objects.create(name="billing", paused=True)
    url = reverse("admin:pgjobs_queue_change", args=["billing"])
    admin_client.post(url, {"name": "billing-renamed", "paused": "on", "max_running": ""})
    assert list(Queue.objects.values_list("name", flat=True)) == ["billing"]


@pytest.mark.parametrize("parameter", ["queue", "task"])
def test_a_nul_in_a_list_filter_is_an_incorrect_lookup_rather_than_a_failure(
    admin_client, parameter
):
    response = admin_client.get(reverse("admin:pgjobs_job_changelist"), {parameter: "a\x00b"})
    assert (response.status_code, response["Location"]) == (302, f"{JOBS}?e=1")
