"""A running job's progress in a real browser (Debian's Chromium, driven by Playwright): a real
`runjobs` process runs a handler that reports its steps, and the Jobs list, reloaded, shows its
bar moving; the job page shows the bar and the note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.browser import test_admin_browser
from tests.browser.test_admin_extras import shots_dir
from tests.browser.test_admin_operator import expect, log_in
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright


def neighbours() -> None:
    """Other jobs around the running one, as a real list has them."""
    JobFactory(succeeded=True, task="tests.tasks.send_email", queue="emails")
    error = "smtplib.SMTPServerDisconnected: Connection unexpectedly closed"
    JobFactory(dead=True, task="tests.tasks.send_email", queue="emails", last_error=error)
    JobFactory(succeeded=True, task="tests.tasks.noop")


def test_a_running_jobs_progress_bar_moves_in_the_jobs_list(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    neighbours()
    job = Job.objects.enqueue("tests.tasks.reports_progress", {"steps": 80, "pause": 0.25})
    worker = WorkerProcess(["--queue", "default"], tmp_path / "worker.log")
    try:
        log_in(page, live_server, django_user_model, "/admin/pgjobs/job/")
        row = page.locator("#result_list tbody tr", has_text=job.short_id)

        def shown() -> int | None:
            """The bar's value after a reload, once the worker has written a report."""
            page.reload()
            bar = row.locator("progress")
            return int(bar.get_attribute("value")) if bar.count() else None

        first = wait_until(shown, timeout=30, interval=0.2)
        later = wait_until(lambda: (value := shown()) is not None and value > first and value, 30)
        assert 0 < first < later <= 100
        expect()(row.locator(".field-status .pgjobs-status")).to_have_text("running")
        expect()(row.locator(".pgjobs-progress-note")).to_contain_text(" of 80")
        # The bar and its note under the status, in its cell; and the whole list fits beside
        # the sidebar and the filters at 1,600 pixels, its last column (the error) included.
        cell = row.locator(".field-status").bounding_box()
        status = row.locator(".field-status .pgjobs-status").bounding_box()
        progress = row.locator(".field-status .pgjobs-progress").bounding_box()
        assert progress["y"] >= status["y"] + status["height"] - 1
        assert (
            cell["x"] <= progress["x"]
            and progress["x"] + progress["width"] <= cell["x"] + cell["width"]
        )
        results = page.locator("#changelist .results")
        assert results.evaluate("e => e.scrollWidth <= e.clientWidth"), "the list overflows"
        error = row.locator(".field-error_line").bounding_box()
        box = results.bounding_box()
        assert error["width"] >= 80 and error["x"] + error["width"] <= box["x"] + box["width"]
        page.screenshot(path=shots_dir(tmp_path) / "admin-job-progress.png")

        row.get_by_role("link", name=job.short_id).click()
        field = page.locator(".field-progress_display")
        expect()(field.locator("progress")).to_be_visible()
        expect()(field.locator(".pgjobs-progress-note")).to_contain_text(" of 80")
        expect()(field).to_contain_text("reported")
        page.screenshot(path=shots_dir(tmp_path) / "admin-job-progress-detail.png")
    finally:
        worker.kill()
    assert Job.objects.get(pk=job.pk).status == Status.RUNNING  # it was caught mid-way
