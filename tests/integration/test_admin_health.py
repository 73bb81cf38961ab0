"""The admin's Queues and health report page through Django's test client."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.test import Client
from django.urls import reverse

from django_pgjobs.models import Queue, QueueStat
from tests.factories import JobFactory
from tests.integration.test_admin import staff

REPORT = reverse("admin:pgjobs_queue_report")
QUEUES = reverse("admin:pgjobs_queue_changelist")


@pytest.mark.django_db(transaction=True)
def test_the_report_page_shows_the_verdict_and_figures_and_escapes_what_it_quotes(
    admin_client, settings, other_connection
):
    settings.PGJOBS = {"HEALTH": {"SNAPSHOT_SECONDS": 0}}
    JobFactory.create_batch(3, queue="emails")
    QueueStat.objects.create(seconds=10, worker="host:1:aa", queue="emails", claimed=7,
                             succeeded=7, latency_buckets=[7])  # fmt: skip
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT '<script>alert(1)</script>' FROM pgjobs_job")
    response = admin_client.get(REPORT)
    other_connection.execute("ROLLBACK")
    assert response.status_code == 200
    content = response.content.decode()
    assert "Verdict: WARNING" in content
    assert "a long transaction is blocking vacuum" in content
    assert "docs/howto/monitoring.md#long-transaction" in content
    assert "<script>alert(1)</script>" not in content
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content
    queues = response.context["data"]["queues"]
    assert [(q["queue"], q["due"], q["workers"]) for q in queues] == [("emails", 3, 1)]
    assert response.context["activity"][0]["claimed"] == 7


@pytest.mark.django_db
def test_the_report_lists_a_worker_that_stopped_as_stopped_and_not_as_serving(admin_client):
    JobFactory(queue="emails")
    QueueStat.objects.create(seconds=10, worker="host:1:aa", queue="emails")
    QueueStat.objects.create(seconds=0, worker="host:1:aa", queue="emails")  # its goodbye
    response = admin_client.get(REPORT)
    assert "stopped 0 s ago" in response.content.decode()
    assert [w.worker for w in response.context["stopped"]] == ["host:1:aa"]
    assert response.context["alive"] == [] and response.context["silent"] == []
    assert [(q["queue"], q["workers"]) for q in response.context["data"]["queues"]] == [
        ("emails", 0)
    ]


@pytest.mark.django_db
def test_the_report_needs_the_permission_to_view_queues():
    assert staff("view_job").get(REPORT).status_code == 403
    assert staff("view_queue").get(REPORT).status_code == 200
    assert Client().get(REPORT).status_code == 302  # to the login page


@pytest.mark.django_db
def test_the_queue_list_links_to_the_report_and_offers_pause_only_with_its_permission():
    Queue.objects.create(name="emails")
    viewer = staff("view_queue", "change_queue").get(QUEUES)
    assert REPORT in viewer.content.decode()
    assert viewer.context["action_form"] is None  # no action this user may take
    pauser = staff("view_queue", "pause_queue").get(QUEUES)
    actions = dict(pauser.context["action_form"].fields["action"].choices)
    assert {"pause", "resume"} <= set(actions)


@pytest.mark.django_db
def test_pause_and_resume_change_only_what_needs_it_and_are_logged():
    for name in ("emails", "reports", "done"):
        Queue.objects.create(name=name)
    Queue.objects.filter(name="done").update(paused=True)
    client = staff("view_queue", "pause_queue")
    data = {"action": "pause", "_selected_action": ["emails", "reports", "done"]}
    response = client.post(QUEUES, data, follow=True)
    assert "2 queues paused." in [str(m) for m in response.context["messages"]]
    assert set(Queue.objects.filter(paused=True).values_list("name", flat=True)) == {
        "emails", "reports", "done"
    }  # fmt: skip
    logged = LogEntry.objects.filter(action_flag=CHANGE, change_message="Paused.")
    assert sorted(logged.values_list("object_id", flat=True)) == ["emails", "reports"]
    client.post(QUEUES, {"action": "resume", "_selected_action": ["emails"]})
    assert list(Queue.objects.filter(paused=False).values_list("name", flat=True)) == ["emails"]


@pytest.mark.django_db
def test_the_list_edits_limits_but_pauses_only_with_the_pause_permission():
    Queue.objects.create(name="emails")
    form = {
        "form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-name": "emails",
        "form-0-paused": "on", "form-0-max_running": "4", "_save": "Save",
    }  # fmt: skip
    response = staff("view_queue", "change_queue").post(QUEUES, form)
    assert response.status_code == 302
    queue = Queue.objects.get()
    assert (queue.paused, queue.max_running) == (False, 4)
    staff("view_queue", "change_queue", "pause_queue").post(QUEUES, form)
    assert Queue.objects.get().paused


@pytest.mark.django_db
def test_a_limit_of_0_stops_a_queue_as_a_pause_does_and_needs_the_pause_permission():
    # max_running = 0 runs nothing: set by a user without pgjobs.pause_queue, it was a pause
    # the permission was meant to keep from them, logged as no pause.
    Queue.objects.create(name="emails")
    form = {
        "form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-name": "emails",
        "form-0-max_running": "0", "_save": "Save",
    }  # fmt: skip
    changer = staff("view_queue", "change_queue")
    response = changer.post(QUEUES, form)
    assert response.status_code == 200  # the list again, with the error
    assert "needs the permission to pause queues" in response.content.decode()
    assert Queue.objects.get().max_running is None
    changer.post(reverse("admin:pgjobs_queue_change", args=["emails"]), {"max_running": "0"})
    assert Queue.objects.get().max_running is None
    staff("view_queue", "change_queue", "pause_queue").post(QUEUES, form)
    assert Queue.objects.get().max_running == 0


@pytest.mark.django_db
def test_lifting_a_limit_of_0_or_deleting_a_stopped_queue_needs_the_pause_permission():
    # Either resumed the queue without pgjobs.pause_queue: a changed max_running of 0, and a
    # deleted row of a paused queue (a queue without a row runs unpaused), logged as
    # "Deleted" (attack 23, F3).
    Queue.objects.create(name="emails", max_running=0)
    Queue.objects.create(name="paused", paused=True)
    changer = staff("view_queue", "change_queue")
    response = changer.post(reverse("admin:pgjobs_queue_change", args=["emails"]), {})
    assert "changing it resumes the queue" in response.content.decode()
    assert Queue.objects.get(name="emails").max_running == 0
    deleter = staff("view_queue", "delete_queue")
    data = {"action": "delete_selected", "_selected_action": ["emails", "paused"], "post": "yes"}
    deleter.post(QUEUES, data)
    assert Queue.objects.count() == 2
    deleter.post(reverse("admin:pgjobs_queue_delete", args=["paused"]), {"post": "yes"})
    assert Queue.objects.count() == 2
    Queue.objects.create(name="open")
    deleter.post(QUEUES, {**data, "_selected_action": ["open"]})
    assert Queue.objects.count() == 2  # a running queue's row: deleted
    everything = staff("view_queue", "change_queue", "delete_queue", "pause_queue")
    everything.post(reverse("admin:pgjobs_queue_change", args=["emails"]), {})
    assert Queue.objects.get(name="emails").max_running is None
    everything.post(QUEUES, data)
    assert Queue.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_charts_that_cannot_be_drawn_in_time_leave_the_report_page_and_say_so(
    admin_client, settings, monkeypatch
):
    # The charts read a day of every worker's statistics with no time limit: 4-7 s a load with
    # 100 workers, more as they grow (attack 23, F6).
    from django_pgjobs.admin import charts

    settings.PGJOBS = {"HEALTH": {"REPORT_STATEMENT_SECONDS": 0.2}}
    monkeypatch.setattr(charts, "SERIES_SQL", charts.SERIES_SQL.replace(
        "WHERE kind", "WHERE pg_sleep(1)::text IS NOT NULL AND kind"
    ))  # fmt: skip
    QueueStat.objects.create(seconds=10, worker="host:1:aa", queue="default", succeeded=1)
    page = admin_client.get(REPORT)
    assert page.status_code == 200
    said = [str(m) for m in page.context["messages"]]
    assert said and said[0].startswith("The charts could not be drawn within the report's time")
    assert "canceling statement due to statement timeout" in said[0]


@pytest.mark.django_db(transaction=True)
def test_saving_a_queue_another_session_holds_gives_up_and_says_so(
    admin_client, other_connection, monkeypatch
):
    # It waited as long as the other session held the row (attack 23, F2)
    import time

    from django_pgjobs.admin import actions

    monkeypatch.setattr(actions, "ACTION_LOCK_WAIT", "300ms")
    Queue.objects.create(name="emails")
    other_connection.execute("BEGIN")
    other_connection.execute("SELECT 1 FROM pgjobs_queue WHERE name = 'emails' FOR UPDATE")
    url = reverse("admin:pgjobs_queue_change", args=["emails"])
    started = time.monotonic()
    response = admin_client.post(url, {"max_running": "3"})
    assert time.monotonic() - started < 5
    assert (response.status_code, response["Location"]) == (302, url)
    said = [str(m) for m in admin_client.get(url).context["messages"]]
    assert said and "canceling statement due to lock timeout" in said[0], said
    other_connection.execute("ROLLBACK")
    assert Queue.objects.get().max_running is None


@pytest.mark.django_db
def test_the_queue_list_says_running_or_paused_in_words_and_labels_the_pause_toggle():
    # A viewer saw `paused` as Django's boolean icon: a green tick for a paused queue, a red
    # cross for a running one.
    Queue.objects.create(name="emails")
    Queue.objects.create(name="reports", paused=True)
    Queue.objects.create(name="batch", max_running=0)
    viewer = staff("view_queue").get(QUEUES).content.decode()
    assert re.findall(r'<td class="field-state">(.*?)</td>', viewer) == [
        "Stopped (max running 0)", "Running", "Paused",
    ]  # fmt: skip
    assert "field-paused" not in viewer and "icon-yes.svg" not in viewer
    pauser = staff("view_queue", "change_queue", "pause_queue").get(QUEUES).content.decode()
    assert re.findall(r'<td class="field-state">(.*?)</td>', pauser) == [
        "Stopped (max running 0)", "Running", "Paused",
    ]  # fmt: skip
    toggle = re.search(r'<input type="checkbox" name="form-2-paused"[^>]*>', pauser)
    assert toggle and 'aria-label="reports paused"' in toggle[0] and "checked" in toggle[0]


@pytest.mark.django_db
def test_each_live_worker_on_the_report_links_to_the_jobs_it_holds(admin_client):
    QueueStat.objects.create(seconds=10, worker="web-1:7:a&b", queue="emails")
    JobFactory(running=True, worker="web-1:7:a&b", queue="emails")
    JobFactory(running=True, worker="web-2:9:c", queue="emails")
    page = admin_client.get(REPORT).content.decode()
    link = f"{reverse('admin:pgjobs_job_changelist')}?worker=web-1%3A7%3Aa%26b"
    assert f'href="{link}"' in page
    assert admin_client.get(link).context["cl"].result_count == 1
