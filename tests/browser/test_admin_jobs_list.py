"""The Jobs list in a real browser (Debian's Chromium, driven by Playwright) at 1440 pixels: every
column on the screen beside the sidebar and the filters, a stuck job among the others."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from tests.browser import test_admin_browser
from tests.browser.test_admin_extras import shots_dir
from tests.browser.test_admin_operator import expect, log_in
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright


def a_busy_list() -> None:
    """Jobs as a busy list has them: long task names, long errors, a bar, a stuck job."""
    error = "smtplib.SMTPServerDisconnected: Connection unexpectedly closed by smtp.example.com"
    task = "example_project.shop.tasks.send_the_quarterly_vat_report_to_every_customer"
    JobFactory.create_batch(3, dead=True, task=task, queue="reports", last_error=error)
    JobFactory(succeeded=True, task="tests.tasks.send_email", queue="emails")
    JobFactory(retrying=True, task="tests.tasks.send_email", queue="emails", last_error=error)
    JobFactory(future=True, task="tests.tasks.noop", priority=2)
    JobFactory(running=True, task=task, progress={"done": 120, "total": 900, "note": "page 4"})
    stuck = JobFactory(expired=True, task=task, progress={"done": 5, "total": 10})
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET created_at = now() - interval '10 minutes', run_at = now() - "
            "interval '10 minutes', started_at = now() - interval '9 minutes', leased_until = "
            "now() - interval '4 minutes' WHERE id = %s",
            [stuck.pk],
        )
    days_ago, hours_ago = timezone.now() - timedelta(days=12), timezone.now() - timedelta(hours=3)
    JobFactory(dead=True, created_at=days_ago, run_at=days_ago, finished_at=hours_ago,
               last_error=error)  # fmt: skip


def test_every_column_of_the_jobs_list_shows_at_1440_pixels(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    a_busy_list()
    page.set_viewport_size({"width": 1440, "height": 900})
    log_in(page, live_server, django_user_model, "/admin/pgjobs/job/")
    expect()(page.locator("#result_list .pgjobs-status.stuck")).to_have_text("stuck")
    page.screenshot(path=shots_dir(tmp_path) / "admin-jobs-1440.png")
    results = page.locator("#changelist .results")
    assert results.evaluate("e => e.scrollWidth <= e.clientWidth"), "the list overflows"
    box = results.bounding_box()
    for column, least in (("finished", 40), ("error_line", 80)):
        header = page.locator(f"#result_list th.column-{column}").bounding_box()
        assert header is not None and header["width"] >= least, column
        assert header["x"] + header["width"] <= box["x"] + box["width"] + 1, column
    error = page.locator("#result_list td.field-error_line .pgjobs-error").first
    assert error.get_attribute("title").startswith("smtplib.SMTPServerDisconnected: Connection")

    # The stuck job's page says why, greys its last report, and says where its time went.
    page.locator("#result_list tr", has=page.locator(".pgjobs-status.stuck")).locator("a").click()
    expect()(page.locator(".field-status_display")).to_contain_text("stopped heartbeating")
    expect()(page.locator(".field-progress_display .pgjobs-stalled progress")).to_be_visible()
    expect()(page.locator(".field-time_spent")).to_contain_text("so far")
    page.screenshot(path=shots_dir(tmp_path) / "admin-job-stuck.png", full_page=True)
