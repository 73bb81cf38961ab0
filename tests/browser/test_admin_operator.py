"""What an operator does in the admin, in a real browser (Debian's Chromium, driven by
Playwright): search, save the Queues list, delete and cancel, read times and the error history."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.contrib.admin.models import LogEntry
from django.test import override_settings
from django.utils import timezone

from django_pgjobs.models import Job, Queue, QueueStat, Schedule
from django_pgjobs.status import Status
from tests.browser import test_admin_browser
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright
SCREENSHOTS = test_admin_browser.SCREENSHOTS

PASSWORD = "correct-horse"


def log_in(page: Any, live_server: Any, django_user_model: Any, path: str) -> None:
    """Log in as a superuser, landing on `path`."""
    if not django_user_model.objects.filter(username="operator").exists():
        django_user_model.objects.create_superuser("operator", "ops@example.com", PASSWORD)
    page.goto(f"{live_server.url}/admin/login/?next={path}")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    # The form posts and redirects: a reload before the redirect lands races it in Chromium.
    page.wait_for_url(lambda url: "/admin/login/" not in url)


def expect() -> Any:
    from playwright.sync_api import expect

    return expect


# ---- the Queues list saves ------------------------------------------------------------------


def test_editing_paused_and_max_running_in_the_queues_list_and_pressing_save_saves(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    Queue.objects.create(name="emails")
    Queue.objects.create(name="reports", paused=True, max_running=2)
    log_in(page, live_server, django_user_model, "/admin/pgjobs/queue/")

    row = page.locator("#result_list tbody tr", has_text="emails")
    row.locator("input[name$='-paused']").check()
    row.locator("input[name$='-max_running']").fill("3")
    page.get_by_role("button", name="Save").click()

    expect()(page.locator(".messagelist")).to_contain_text("was changed successfully")
    emails = Queue.objects.get(name="emails")
    assert (emails.paused, emails.max_running) == (True, 3)
    assert Queue.objects.get(name="reports").max_running == 2  # untouched
    assert LogEntry.objects.filter(object_id="emails").exists()


# ---- running jobs cannot be deleted -------------------------------------------------------------


def job_page(live_server: Any, job: Job) -> str:
    return f"{live_server.url}/admin/pgjobs/job/{job.pk}/change/"


def test_a_running_job_offers_cancel_not_delete_and_its_delete_page_refuses(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    running = JobFactory(running=True)
    log_in(page, live_server, django_user_model, f"/admin/pgjobs/job/{running.pk}/change/")

    expect()(page.locator(".pgjobs-cancel")).to_be_visible()
    expect()(page.locator("a.deletelink")).to_have_count(0)

    page.goto(f"{live_server.url}/admin/pgjobs/job/{running.pk}/delete/")
    expect()(page.locator(".messagelist")).to_contain_text("cannot be deleted while it runs")
    assert page.url == job_page(live_server, running)
    assert Job.objects.get(pk=running.pk).status == Status.RUNNING


def test_a_finished_job_is_deleted_from_its_page_and_the_deletion_logged(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    done = JobFactory(succeeded=True)
    log_in(page, live_server, django_user_model, f"/admin/pgjobs/job/{done.pk}/change/")
    page.locator("a.deletelink").click()
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect()(page.locator(".messagelist")).to_contain_text("was deleted successfully")
    assert not Job.objects.filter(pk=done.pk).exists()
    assert LogEntry.objects.filter(object_id=str(done.pk), action_flag=3).exists()


def test_deleting_only_running_jobs_says_they_were_skipped_and_why(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    running = JobFactory.create_batch(2, running=True)
    log_in(page, live_server, django_user_model, "/admin/pgjobs/job/")
    for job in running:
        page.locator(f"input.action-select[value='{job.pk}']").check()
    page.select_option("select[name=action]", "delete_jobs")
    # The actions' submit button: "Go" up to Django 5.2, "Run" from Django 6.
    page.locator(".actions button[name=index]").click()
    expect()(page.locator(".pgjobs-count")).to_have_text("Delete 2 jobs?")
    page.get_by_role("button", name="Yes, I’m sure").click()

    message = page.locator(".messagelist li")
    expect()(message).to_have_class("warning")
    expect()(message).to_have_text(
        "0 jobs deleted. 2 skipped: running jobs are not deleted while their worker runs "
        "them; cancel them instead."
    )
    assert Job.objects.filter(status=Status.RUNNING).count() == 2


# ---- times in the active time zone ----------------------------------------------------------


@override_settings(TIME_ZONE="America/New_York")
def test_times_show_in_the_active_time_zone_to_the_second_labelled_with_ages_in_lists(
    page: Any, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    settings.PGJOBS = {
        **settings.PGJOBS,
        "PERIODIC": {
            "daily": {"task": "tests.tasks.periodic_tick", "cron": "30 12 * * *", "pass_tick": True}
        },
    }
    failed_at = timezone.now() - timedelta(minutes=3, seconds=5)
    job = JobFactory(
        dead=True, finished_at=failed_at,
        errors=[{"attempt": 1, "at": "2026-03-02T07:04:58.520113+00:00", "worker": "w1",
                 "type": "KeyError", "message": "'user'"}],
    )  # fmt: skip
    Schedule.objects.create(
        name="daily", task="tests.tasks.periodic_tick", cron="30 12 * * *", timezone="UTC",
        last_tick=datetime(2026, 3, 2, 12, 30, tzinfo=UTC),
    )  # fmt: skip
    local = timezone.localtime(failed_at, ZoneInfo("America/New_York"))
    log_in(page, live_server, django_user_model, "/admin/pgjobs/deadletter/")

    finished = page.locator("#result_list .field-finished time")
    expect()(finished).to_have_text("3 min ago")
    expect()(finished).to_have_attribute("title", re.compile(local.strftime(r"%H:%M:%S E[SD]T$")))

    page.get_by_role("link", name=job.short_id).click()
    history = page.locator(".pgjobs-timeline .meta")
    expect()(history).to_contain_text("March 2, 2026, 02:04:58 EST")  # 07:04:58 UTC
    expect()(history).not_to_contain_text("+00:00")
    expect()(page.locator(".field-finished_at_display")).to_contain_text(local.strftime("%H:%M:%S"))
    expect()(page.locator(".field-finished_at_display")).to_contain_text("(3 min ago)")

    page.goto(f"{live_server.url}/admin/pgjobs/schedule/")
    expect()(page.locator("#result_list .field-next")).to_contain_text(
        "March 3, 2026, 07:30:00 EST"  # 12:30 UTC
    )
    expect()(page.locator("#result_list .field-last")).to_contain_text(
        "March 2, 2026, 07:30:00 EST"
    )


# ---- search ---------------------------------------------------------------------------------


def test_the_search_box_finds_a_job_by_short_id_id_prefix_and_task_name_on_both_lists(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    wanted = JobFactory(
        dead=True, task="tests.tasks.send_email", queue="emails",
        last_error="smtplib.SMTPServerDisconnected: Connection unexpectedly closed while "
        "sending to ada@example.com after 3 attempts; the server said: 421 try again later",
    )  # fmt: skip
    JobFactory.create_batch(3, dead=True)
    live = JobFactory(task="tests.tasks.send_email", queue="emails", running=True)
    Job.objects.filter(pk=live.pk).cancel()  # running: cancelling until its attempt ends
    log_in(page, live_server, django_user_model, "/admin/pgjobs/job/")
    rows = page.locator("#result_list tbody tr")

    def search_for(term: str) -> None:
        page.fill("#searchbar", term)
        page.press("#searchbar", "Enter")

    search_for(wanted.short_id)
    expect()(rows).to_have_count(1)
    expect()(rows.first.locator(".field-short_id")).to_have_text(wanted.short_id)

    search_for(str(wanted.pk))
    expect()(rows).to_have_count(1)

    search_for("send_email")
    expect()(rows).to_have_count(2)
    expect()(rows.first.locator(".field-short_id")).to_have_text(live.short_id)
    expect()(rows.first.locator(".field-status")).to_have_text("cancelling")
    # The last error is on screen, in the room the other columns leave (at most three lines,
    # ending in an ellipsis), whole on hover.
    error = rows.nth(1).locator(".field-error_line")
    cell, filters = error.bounding_box(), page.locator("#changelist-filter").bounding_box()
    assert cell["x"] + cell["width"] <= filters["x"]
    assert error.locator(".pgjobs-error").bounding_box()["height"] < 60
    expect()(error.locator("span")).to_have_attribute("title", re.compile("421 try again later$"))
    shots = SCREENSHOTS if os.environ.get("PGJOBS_SCREENSHOTS") else tmp_path
    page.screenshot(path=shots / "admin-jobs-search.png")

    page.goto(f"{live_server.url}/admin/pgjobs/deadletter/")
    search_for("send_email")
    expect()(rows).to_have_count(1)
    expect()(rows.first.locator(".field-short_id")).to_have_text(wanted.short_id)
    search_for(str(wanted.pk)[:7])  # the start of the id: the jobs of the same 17 minutes
    expect()(rows).to_have_count(4)


# ---- replay into a queue no worker serves ----------------------------------------------------


def test_replay_into_a_queue_no_worker_serves_warns_and_offers_the_served_ones(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    for queue in ("default", "emails"):
        QueueStat.objects.create(worker="web-1:41:a", queue=queue, seconds=10)
    job = JobFactory(dead=True, task="tests.tasks.send_email", queue="emails")
    log_in(page, live_server, django_user_model, f"/admin/pgjobs/deadletter/{job.pk}/change/")
    page.get_by_role("button", name="Replay…").click()
    expect()(page.locator(".helptext")).to_contain_text("Live workers serve: default, emails.")
    options = page.locator("datalist#pgjobs-served-queues option")
    assert [options.nth(n).get_attribute("value") for n in range(options.count())] == [
        "default", "emails",
    ]  # fmt: skip

    page.fill("#id_queue", "emalis")
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect()(page.locator(".errorlist")).to_contain_text("No live worker serves the queue “emalis”")
    shots = SCREENSHOTS if os.environ.get("PGJOBS_SCREENSHOTS") else tmp_path
    page.screenshot(path=shots / "admin-replay-unserved.png")
    assert Job.objects.get(pk=job.pk).status == Status.FAILED

    page.fill("#id_queue", "emails")
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect()(page.locator(".messagelist")).to_contain_text("1 job replayed.")
    assert Job.objects.get(pk=job.pk).status == Status.READY
