"""The jobs dashboard and a large replay in a real browser (Debian's Chromium, driven by
Playwright): the jobs by state per queue and task, each number a link to its list (the stuck
ones included); live refresh picking up jobs enqueued meanwhile; "Replay all matching" over more
jobs than a request changes, run as a job whose page shows its progress."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.db.models.functions import Now

from django_pgjobs.admin import operations
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Outcome
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests.browser import test_admin_browser
from tests.browser.test_admin_extras import shots_dir
from tests.browser.test_admin_operator import expect, log_in
from tests.factories import JobFactory
from tests.integration.test_admin_operations import dead_letters
from tests.integration.test_dashboard import report

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright


def test_the_dashboard_links_each_state_and_refreshes_live(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    JobFactory.create_batch(4, queue="emails", task="tests.tasks.send_email")
    JobFactory(queue="emails", task="tests.tasks.send_email", run_at=Now() + timedelta(hours=1))
    JobFactory(queue="emails", task="tests.tasks.noop", running=True)
    JobFactory.create_batch(2, queue="default", task="tests.tasks.noop", expired=True)
    JobFactory(queue="default", dead=True)
    report("web-1:7:a", "emails", [("tests.tasks.send_email", Outcome.SUCCEEDED, 0.2)] * 40
           + [("tests.tasks.send_email", Outcome.RETRIED, 1.5)] * 3)  # fmt: skip

    log_in(page, live_server, django_user_model, "/admin/pgjobs/job/dashboard/")
    totals = page.locator("#totals")
    expect()(totals.locator(".due .count")).to_have_text("4")
    expect()(totals.locator(".expired")).to_contain_text("stuck")
    expect()(totals.locator(".expired .count")).to_have_text("2")
    tasks_table = page.locator("#tasks")
    send_email = tasks_table.locator("tr", has_text="tests.tasks.send_email")
    expect()(send_email).to_contain_text("43")  # runs in the last hour
    expect()(send_email).to_contain_text("7%")  # 3 of 43 raised
    page.screenshot(path=shots_dir(tmp_path) / "admin-dashboard.png", full_page=True)

    # The stuck count lists the stuck jobs, marked as such.
    totals.locator(".expired").click()
    rows = page.locator("#result_list tbody tr")
    expect()(rows).to_have_count(2)
    expect()(rows.first).to_contain_text("stuck")
    page.screenshot(path=shots_dir(tmp_path) / "admin-stuck.png", full_page=True)

    # Live: jobs enqueued meanwhile show up without a reload of the page.
    page.go_back()
    page.get_by_label("Live (every 5 s)").check()
    JobFactory.create_batch(3, queue="emails", task="tests.tasks.send_email")
    expect()(totals.locator(".due .count")).to_have_text("7", timeout=15_000)
    expect()(page.locator("#pgjobs-live-status")).to_contain_text("updated")
    page.reload()  # the toggle is remembered
    expect()(page.get_by_label("Live (every 5 s)")).to_be_checked()


def test_replaying_every_dead_letter_runs_as_a_job_with_its_progress(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(operations, "LARGE", 500)  # the live server runs in this process
    dead_letters(2000, task="tests.tasks.send_email")
    log_in(page, live_server, django_user_model, "/admin/pgjobs/deadletter/")
    page.get_by_role("link", name="Replay all matching").click()
    expect()(page.locator(".pgjobs-as-a-job")).to_contain_text("changed by a job of the queue")
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect()(page.locator(".messagelist")).to_contain_text("runs as a job")
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    assert f"/admin/pgjobs/job/{operation.pk}/change/" in page.url
    assert Job.objects.filter(queue="parked", status=Status.FAILED).count() == 2000

    run_jobs(tasks=[operations.operate])
    page.reload()
    expect()(page.locator(".field-progress_display")).to_contain_text("2,000 of 2,000")
    page.screenshot(path=shots_dir(tmp_path) / "admin-large-replay.png", full_page=True)
    assert Job.objects.filter(queue="parked", status=Status.READY).count() == 2000
    assert LogEntry.objects.count() == 1
