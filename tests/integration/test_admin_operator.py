"""The operator's admin through Django's test client: deletes that refuse running jobs, the
confirmation pages' sentences, cancelling, the replay history, the replay queue warning."""

from __future__ import annotations

import html

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.urls import reverse
from django.utils import dateformat, timezone
from django.utils.formats import get_format

from django_pgjobs import registry
from django_pgjobs.admin import actions
from django_pgjobs.models import Job, Queue, QueueStat
from django_pgjobs.status import Status
from tests.factories import JobFactory
from tests.integration.test_admin import DEAD, JOBS, act, log_for, messages_of, reload

pytestmark = pytest.mark.django_db


def delete_url(job: Job, model: str = "job") -> str:
    return reverse(f"admin:pgjobs_{model}_delete", args=[job.pk])


# ---- delete ---------------------------------------------------------------------------------


def test_a_posted_delete_of_a_running_job_is_refused_and_changes_nothing(admin_client):
    running = JobFactory(running=True)
    response = admin_client.post(delete_url(running), {"post": "yes"}, follow=True)
    assert "cannot be deleted while it runs" in messages_of(response)[0]
    assert response.redirect_chain[-1][0] == reverse("admin:pgjobs_job_change", args=[running.pk])
    assert reload(running).status == Status.RUNNING
    assert not LogEntry.objects.exists()


def test_a_job_that_started_running_after_the_confirmation_page_is_not_deleted(admin_client):
    job = JobFactory()
    page = admin_client.get(delete_url(job))
    assert page.status_code == 200
    Job.objects.claim(["default"], worker="w1", limit=1)  # claimed while the page was open
    response = admin_client.post(delete_url(job), {"post": "yes"}, follow=True)
    assert "cannot be deleted while it runs" in messages_of(response)[0]
    assert reload(job).status == Status.RUNNING and log_for(job) == []


def test_the_job_page_deletes_a_finished_job_through_the_guarded_delete_and_logs_it(
    admin_client, admin_user
):
    job = JobFactory(dead=True)
    response = admin_client.post(delete_url(job), {"post": "yes"}, follow=True)
    assert messages_of(response) == [f"The job “{job}” was deleted successfully."]
    assert not Job.objects.filter(pk=job.pk).exists()
    assert log_for(job) == [(admin_user.username, DELETION, "Deleted.")]


def test_the_running_job_page_offers_cancel_and_no_delete(admin_client):
    running = JobFactory(running=True)
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[running.pk]))
    assert page.context["has_delete_permission"] is False
    assert [name for name, _ in page.context["job_actions"]] == ["cancel"]


def test_deleting_a_selection_of_running_jobs_reports_them_skipped_as_a_warning(admin_client):
    running, done = JobFactory(running=True), JobFactory(succeeded=True)
    response = act(admin_client, JOBS, "delete_jobs", [running, done])
    assert messages_of(response) == [
        "1 job deleted. 1 skipped: running jobs are not deleted while their worker runs them; "
        "cancel them instead."
    ]
    assert [m.level_tag for m in response.context["messages"]] == ["warning"]
    assert reload(running).status == Status.RUNNING
    assert log_for(running) == []


# ---- the confirmation pages ask in sentences ----------------------------------------------------


@pytest.mark.parametrize(
    ("action", "factory", "title", "one", "two"),
    [
        ("replay", {"dead": True}, "Replay jobs", "Replay 1 job?", "Replay 2 jobs?"),
        ("run_now", {"future": True}, "Run jobs now", "Run 1 job now?", "Run 2 jobs now?"),
        ("cancel", {}, "Cancel jobs", "Cancel 1 job?", "Cancel 2 jobs?"),
        ("delete_jobs", {}, "Delete jobs", "Delete 1 job?", "Delete 2 jobs?"),
    ],
)
def test_each_confirmation_page_asks_a_proper_question(
    admin_client, action, factory, title, one, two
):
    jobs = JobFactory.create_batch(2, **factory)
    for selected, question in ((jobs[:1], one), (jobs, two)):
        page = act(admin_client, JOBS, action, selected, confirm=False)
        assert page.context["title"] == title
        assert f'<p class="pgjobs-count">{question}</p>' in page.content.decode()


# ---- cancelling -------------------------------------------------------------------------------


def test_a_running_job_asked_to_cancel_shows_cancelling_and_is_logged_as_requested(
    admin_client, admin_user
):
    ready, running = JobFactory(), JobFactory(running=True)
    act(admin_client, JOBS, "cancel", [ready, running])
    assert log_for(ready) == [(admin_user.username, CHANGE, "Cancelled.")]
    assert log_for(running) == [(admin_user.username, CHANGE, "Cancellation requested.")]

    listed = admin_client.get(JOBS).content.decode()
    assert '<span class="pgjobs-status cancelling">cancelling</span>' in listed
    assert '<span class="pgjobs-status ">cancelled</span>' in listed
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[running.pk]))
    assert "cancelling" in page.content.decode()
    assert page.context["job_actions"] == []  # nothing more to ask


# ---- the last error and the replay history ------------------------------------------------------


def test_the_lists_show_the_last_error_on_one_cut_line_with_the_whole_line_on_hover(admin_client):
    long = "ValueError: " + "x" * 200
    JobFactory(dead=True, last_error=f"{long}\nsecond line")
    for url in (JOBS, DEAD):
        content = admin_client.get(url).content.decode()
        assert f'title="{long}"' in content
        assert "ValueError: " + "x" * 67 + "…</span>" in content
        assert "second line" not in content


def test_a_replay_joins_the_history_with_who_when_and_the_queue_and_clears_the_last_error(
    admin_client, admin_user
):
    job = JobFactory(
        dead=True, last_error="PermanentError: no such user",
        errors=[{"attempt": 1, "at": "2026-03-02T09:10:07.52+00:00", "worker": "w1",
                 "type": "PermanentError", "message": "no such user"}],
    )  # fmt: skip
    act(admin_client, DEAD, "replay", [job], queue="emails")
    row = reload(job)
    assert row.last_error == ""
    assert row.errors[0]["type"] == "PermanentError"
    replay = row.errors[-1]
    assert (replay["by"], replay["queue"]) == (admin_user.username, "emails")
    assert "replayed_at" in replay

    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[job.pk])).content.decode()
    assert "Replayed" in page and f"by {admin_user.username}" in page
    assert "into queue emails" in page


def test_the_history_pages_name_the_time_zone_of_their_times(admin_client, settings):
    # Django's History page showed "Dec. 5, 2026, 3:10 p.m." with no zone, beside job pages
    # that name theirs.
    settings.TIME_ZONE = "America/New_York"
    job = JobFactory(dead=True)
    act(admin_client, DEAD, "replay", [job])
    logged = LogEntry.objects.get().action_time
    page = admin_client.get(reverse("admin:pgjobs_job_history", args=[job.pk])).content.decode()
    assert '<th scope="col">Date/time (America/New_York)</th>' in page
    shown = dateformat.format(timezone.localtime(logged), get_format("DATETIME_FORMAT"))
    assert f'<th scope="row">{shown}</th>' in page
    Queue.objects.create(name="emails")  # and the other models' history pages alike
    queues = reverse("admin:pgjobs_queue_changelist")
    admin_client.post(queues, {"action": "pause", "_selected_action": ["emails"]})
    queue = admin_client.get(reverse("admin:pgjobs_queue_history", args=["emails"]))
    assert "Date/time (America/New_York)" in queue.content.decode()


def test_the_replay_entries_keep_the_history_bounded(settings):
    settings.PGJOBS = {**settings.PGJOBS, "ERRORS_KEPT": 3}
    job = JobFactory(dead=True, errors=[{"attempt": n, "type": "E"} for n in (1, 2, 3)])
    for _ in range(2):
        Job.objects.filter(pk=job.pk).replay(by="ops")
        Job.objects.filter(pk=job.pk).update(status=Status.FAILED, finished_at=reload(job).run_at)
    history = reload(job).errors
    assert len(history) == 3
    assert [e.get("attempt") for e in history] == [3, None, None]
    assert [e.get("by") for e in history[1:]] == ["ops", "ops"]


def test_a_job_that_succeeds_after_a_replay_shows_no_last_error(admin_client):
    job = JobFactory(dead=True, last_error="PermanentError: no such user")
    act(admin_client, DEAD, "replay", [job])
    (claimed,) = Job.objects.claim(["default"], worker="w1", limit=1)
    Job.objects.complete(claimed)
    content = admin_client.get(JOBS).content.decode()
    assert "no such user" not in content
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[job.pk])).content.decode()
    assert "PermanentError" not in page.split("error history")[0]


def test_a_replay_is_not_an_error_of_the_django_task_result():
    from django_pgjobs.backend import to_task_result

    job = JobFactory(
        dead=True, task=f"{registry.DJANGO_TASK_PREFIX}tests.framework_tasks.noop",
        payload={"args": [], "kwargs": {}, "backend": "default"},
        errors=[{"attempt": 1, "type": "RuntimeError", "message": "x"}],
    )  # fmt: skip
    Job.objects.filter(pk=job.pk).replay(by="ops")
    assert len(to_task_result(reload(job)).errors) == 1


# ---- replay into a queue no worker serves -------------------------------------------------------


def a_worker_serves(*queues: str) -> None:
    for queue in queues:
        QueueStat.objects.create(worker="web-1:77", queue=queue, seconds=10)


def test_replay_into_a_queue_no_live_worker_serves_warns_once_with_the_served_queues(admin_client):
    a_worker_serves("default", "emails")
    job = JobFactory(dead=True)
    page = act(admin_client, DEAD, "replay", [job], queue="emalis")
    content = page.content.decode()
    assert "No live worker serves the queue “emalis”" in html.unescape(content)
    assert "Live workers serve: default, emails." in html.unescape(content)
    assert '<option value="emails">' in content  # offered as the field's suggestions
    assert reload(job).status == Status.FAILED and log_for(job) == []

    response = act(admin_client, DEAD, "replay", [job], queue="emalis", unserved="emalis")
    assert messages_of(response) == ["1 job replayed."]
    assert reload(job).queue == "emalis"


def test_replay_into_a_served_queue_or_its_own_queue_does_not_warn(admin_client):
    a_worker_serves("default", "emails")
    first, second = JobFactory(dead=True), JobFactory(dead=True, queue="gone")
    assert messages_of(act(admin_client, DEAD, "replay", [first], queue="emails")) == [
        "1 job replayed."
    ]
    assert messages_of(act(admin_client, DEAD, "replay", [second])) == ["1 job replayed."]


def test_a_queue_confirmed_for_one_name_is_asked_again_for_another(admin_client):
    a_worker_serves("default")
    job = JobFactory(dead=True)
    page = act(admin_client, DEAD, "replay", [job], queue="reports", unserved="emalis")
    assert "No live worker serves the queue" in html.unescape(page.content.decode())
    assert reload(job).status == Status.FAILED


def test_a_job_claimed_between_the_read_and_the_cancel_is_logged_as_cancellation_requested(
    admin_user, rf
):
    # The log's words came from the rows as read before the change: a job a worker claimed in
    # between only got a cancellation request (and may well succeed), yet was logged cancelled.
    job = JobFactory()
    request = rf.post("/")
    request.user = admin_user

    def claimed_then_cancelled(rows):
        Job.objects.claim(["default"], worker="w1", limit=1)  # a worker's claim, just then
        return rows.cancel()

    logged = lambda row: str(actions.CANCEL.logged_for(row))  # noqa: E731
    changed, _ = actions.apply(
        request, Job.objects.filter(pk=job.pk), claimed_then_cancelled, CHANGE, logged,
        only=actions.LOGGED,
    )  # fmt: skip
    assert changed == 1 and reload(job).cancel_requested
    assert log_for(job) == [(admin_user.username, CHANGE, "Cancellation requested.")]


# ---- a row held by another session ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["replay", "cancel", "delete_jobs"])
def test_an_action_on_a_row_another_session_holds_gives_up_and_says_so(
    admin_client, other_connection, monkeypatch, action
):
    # It waited for as long as the other session kept its transaction open (for good, for one
    # left open), the rest of its batch changed and uncommitted all along (attack 23, F2).
    from django_pgjobs.data import queryset

    monkeypatch.setattr(actions, "ACTION_LOCK_WAIT", "200ms")
    monkeypatch.setattr(queryset, "CHANGE_TRIES", 2)
    jobs = JobFactory.create_batch(3, **({"dead": True} if action == "replay" else {}))
    other_connection.execute("BEGIN")
    other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [jobs[0].pk])
    response = act(admin_client, DEAD if action == "replay" else JOBS, action, jobs)
    assert messages_of(response) == [
        "3 rows were left as they were: another session held them, or rows of their batches, and "
        "they were waited for 0 s (a transaction left open?). Try again.",
        {"replay": "0 jobs replayed.", "cancel": "0 jobs cancelled (running ones stop if "
         "their handler checks, else finish).", "delete_jobs": "0 jobs deleted."}[action],
    ]  # fmt: skip
    assert [reload(job).status for job in jobs] == [jobs[0].status] * 3
    other_connection.execute("ROLLBACK")
    response = act(admin_client, DEAD if action == "replay" else JOBS, action, jobs)
    assert "Try again" not in " ".join(messages_of(response))


# ---- odd filter values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "query"),
    [
        (JOBS, "status__exact=%00"),
        (DEAD, "status__exact=%00"),
        (DEAD, "error_type=%00"),
        (DEAD, "task=a%00b"),
        (reverse("admin:pgjobs_queue_changelist"), "name=%00"),
    ],
)
def test_a_nul_in_a_filter_is_an_incorrect_lookup_not_a_server_error(admin_client, url, query):
    # PostgreSQL refuses a NUL in a query's text: a server error (attack 23, F7).
    JobFactory(dead=True)
    response = admin_client.get(f"{url}?{query}")
    assert (response.status_code, response["Location"]) == (302, f"{url}?e=1")
    assert admin_client.get(f"{url}?q=%00").status_code == 200  # the search: no rows


@pytest.mark.parametrize("query", ["bogus=1", "status__exact=%00"])
def test_replay_matching_answers_an_incorrect_lookup_as_the_list_does(admin_client, query):
    from tests.integration.test_admin import REPLAY_MATCHING

    response = admin_client.get(f"{REPLAY_MATCHING}?{query}")
    assert (response.status_code, response["Location"]) == (302, f"{DEAD}?e=1")


def test_a_job_whose_payload_python_cannot_read_still_has_its_pages(admin_client):
    # A payload nested deeper than Python's recursion limit (written by SQL: enqueue refuses
    # it) made its page, its history and its edit-payload page server errors (attack 23, F8).
    from django.db import connection

    job = JobFactory(dead=True)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET payload = jsonb_build_object('d', "
            "(repeat('[', 5000) || repeat(']', 5000))::jsonb) WHERE id = %s",
            [job.pk],
        )
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[job.pk]))
    assert page.status_code == 200
    assert "This JSON cannot be read in Python (RecursionError" in page.content.decode()
    assert admin_client.get(reverse("admin:pgjobs_job_history", args=[job.pk])).status_code == 200
    edit = admin_client.get(reverse("admin:pgjobs_deadletter_edit_payload", args=[job.pk]))
    assert edit.status_code == 302
    assert "payload cannot be read in Python" in " ".join(
        messages_of(admin_client.get(edit["Location"]))
    )


@pytest.mark.parametrize("field", ["payload", "result", "errors", "progress", "headers"])
@pytest.mark.parametrize(
    "page",
    [
        "admin:pgjobs_job_change",
        "admin:pgjobs_job_history",
        "admin:pgjobs_deadletter_change",
        "admin:pgjobs_job_delete",
        "admin:pgjobs_job_changelist",
        "admin:pgjobs_deadletter_changelist",
    ],
)
def test_any_json_of_a_job_that_python_cannot_read_leaves_its_pages_open(admin_client, field, page):
    from django.db import connection

    job = JobFactory(dead=True)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE pgjobs_job SET {field} = "
            "jsonb_build_array((repeat('[', 5000) || repeat(']', 5000))::jsonb) WHERE id = %s",
            [job.pk],
        )
    if page.endswith("changelist") and field == "progress":
        pytest.skip("a list shows a running job's progress: left undone")
    args = [] if page.endswith("changelist") else [job.pk]
    response = admin_client.get(reverse(page, args=args))
    assert response.status_code == 200
