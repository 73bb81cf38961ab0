"""A batch in a real browser (Debian's Chromium, driven by Playwright): its page with a dead
letter among its jobs, Replay failed members from it, and the pages of a member and of a job
that waits for the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import django_pgjobs
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import tasks
from tests.browser import test_admin_browser
from tests.browser.test_admin_extras import shots_dir
from tests.browser.test_admin_operator import expect, log_in

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright


def test_an_operator_replays_a_batchs_dead_letter_from_its_page_and_the_waiting_job_runs(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    with django_pgjobs.batch(on_complete=tasks.batch_done, on_success=tasks.mail, name="export"):
        for n in range(1, 8):
            tasks.part.enqueue(n=n)
        dead = tasks.part.enqueue(n=8, fail=True)
    b = Batch.objects.get()
    report = tasks.step.using(after=[b]).enqueue(name="report")
    run_jobs(queues=["batches"], tasks=[tasks.part])
    assert Job.objects.get(pk=dead.pk).status == Status.FAILED
    assert Job.objects.get(pk=report.pk).status == Status.CANCELLED  # its batch did not succeed

    log_in(page, live_server, django_user_model, "/admin/pgjobs/batch/")
    row = page.locator("#result_list tbody tr", has_text=b.short_id)
    expect()(row.locator(".field-progress progress")).to_have_attribute("value", "100")
    expect()(row.locator(".pgjobs-progress-note")).to_contain_text("completed with 1 failed")
    row.get_by_role("link", name=b.short_id).click()

    # The batch's page: its jobs by status, each count a link; its callbacks; the button.
    counts = page.locator(".pgjobs-members")
    expect()(counts.locator(".pgjobs-members-succeeded .count")).to_have_text("7")
    expect()(counts.locator(".pgjobs-members-failed .count")).to_have_text("1")
    expect()(page.locator(".field-state")).to_contain_text("completed, not succeeded")
    expect()(page.locator(".field-progress_display")).to_contain_text("8 of 8 (100%)")
    callback = Job.objects.get(task=tasks.batch_done.name)
    expect()(page.locator(".field-on_complete_display a")).to_have_text(callback.short_id)
    expect()(page.locator(".field-on_success_display")).to_contain_text(
        "enqueued once every job has succeeded"
    )
    expect()(page.locator(".pgjobs-replay-failed")).to_be_visible()
    page.screenshot(path=shots_dir(tmp_path) / "admin-batch.png", full_page=True)

    # The count of dead letters lists them in Jobs; the member's page links its batch.
    counts.locator(".pgjobs-members-failed a").click()
    rows = page.locator("#result_list tbody tr")
    expect()(rows).to_have_count(1)
    expect()(page.locator("#changelist-filter")).to_contain_text(f"batch {b.short_id}")
    rows.first.get_by_role("link", name=dead.short_id).click()
    expect()(page.locator(".field-batch_display")).to_contain_text(f"batch {b.short_id}")

    # The job that waits for the batch: cancelled, the batch marked as the one that failed.
    page.goto(f"{live_server.url}/admin/pgjobs/job/{report.pk}/change/")
    wait = page.locator(".field-dependencies_display .pgjobs-wait")
    expect()(wait).to_have_class("pgjobs-wait pgjobs-wait-failed")
    expect()(wait).to_contain_text("failed: it cancelled this job")
    expect()(page.locator(".field-last_error")).to_contain_text("DependencyFailed: batch")
    wait.get_by_role("link", name=b.short_id).click()

    # Replay failed members, its payload corrected first (it failed on purpose).
    Job.objects.filter(pk=dead.pk).replace_payload({"n": 8})
    page.locator(".pgjobs-replay-failed").click()
    expect()(page.locator(".pgjobs-count")).to_have_text("Replay 1 job?")
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect()(page.locator(".messagelist")).to_contain_text("1 job replayed.")
    expect()(page.locator(".pgjobs-members-ready .count")).to_have_text("1")
    expect()(page.locator(".pgjobs-replay-failed")).to_have_count(0)

    run_jobs(queues=["batches"])  # the member, then the job released by the batch's success
    page.reload()
    expect()(page.locator(".field-state .readonly")).to_have_text("succeeded")
    expect()(page.locator(".pgjobs-members-succeeded .count")).to_have_text("8")
    on_success = Job.objects.get(task=tasks.mail.name)
    expect()(page.locator(".field-on_success_display a")).to_have_text(on_success.short_id)
    page.goto(f"{live_server.url}/admin/pgjobs/job/{report.pk}/change/")
    expect()(page.locator(".field-status_display .readonly")).to_have_text("succeeded")
    wait = page.locator(".field-dependencies_display .pgjobs-wait")
    expect()(wait).to_have_class("pgjobs-wait")
    expect()(wait.locator(".pgjobs-wait-status")).to_have_text("succeeded")
