"""Beyond the lists, in a real browser (Debian's Chromium, driven by Playwright): the health
report's charts in the light and dark themes, and fixing a dead letter's payload before replay."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.utils import timezone

from django_pgjobs.models import Job, QueueStat
from django_pgjobs.status import Status
from tests.browser import test_admin_browser
from tests.browser.test_admin_operator import PASSWORD, expect, log_in
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)
page = test_admin_browser.page  # the fixture: Chromium with Playwright


def shots_dir(tmp_path: Path) -> Path:
    return test_admin_browser.SCREENSHOTS if os.environ.get("PGJOBS_SCREENSHOTS") else tmp_path


def worker_history() -> None:
    """An hour of two queues' QueueStat rows, a minute each: a burst of work, some retries."""
    now = timezone.now()
    for minute in range(60):
        busy = 20 <= minute < 35
        QueueStat.objects.create(
            at=now - timedelta(minutes=minute), seconds=60, worker="web-1:41:a", queue="emails",
            claimed=300 if busy else 40, succeeded=290 if busy else 40,
            retried=12 if busy else 0, failed=3 if busy and minute % 3 == 0 else 0,
            latency_buckets=[0, 0, 5, 20, 200, 60, 15] if busy else [30, 10],
            # Yielding to the application through the burst, at 5 jobs/s.
            yielded=60.0 if busy else 0.0, allowed=5.0 if busy else None,
            open_ms=4.2 if busy else 1.9, baseline_ms=2.0,
        )  # fmt: skip
        QueueStat.objects.create(
            at=now - timedelta(minutes=minute, seconds=20), seconds=60, worker="web-2:9:b",
            queue="reports", claimed=4, succeeded=4, latency_buckets=[0, 0, 0, 4],
        )  # fmt: skip


def test_the_health_report_draws_its_charts_with_their_numbers_in_both_themes(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    worker_history()
    log_in(page, live_server, django_user_model, "/admin/pgjobs/queue/report/")

    hour = page.locator("#charts-1")
    expect()(hour.locator("h2")).to_have_text("Last hour")
    expect()(hour.locator("figure")).to_have_count(5)
    yielding = hour.locator("figure").nth(4)
    expect()(yielding.locator("figcaption")).to_contain_text("allowed while yielding")
    expect()(yielding.locator("polyline")).to_have_count(3)  # claimed ×2, emails' allowed
    yielding.scroll_into_view_if_needed()
    yielding.screenshot(path=shots_dir(tmp_path) / "admin-health-yielding.png")
    throughput = hour.locator("figure").first
    expect()(throughput.locator("polyline")).to_have_count(2)  # a line per queue
    # A column per point: under the pointer, every line's number there.
    expect()(throughput.locator("rect.point title").first).to_contain_text("jobs/min")
    assert "emails " in throughput.locator("rect.point title").nth(25).text_content()
    assert "reports " in throughput.locator("rect.point title").nth(25).text_content()
    point = throughput.locator("rect.point").nth(25)
    point.hover()
    expect()(point).to_have_css("fill-opacity", "0.15")  # shown under the pointer

    def axis_colour() -> str:
        return str(throughput.locator("text.axis").first.evaluate("e => getComputedStyle(e).fill"))

    light = axis_colour()
    page.screenshot(path=shots_dir(tmp_path) / "admin-health-charts.png", full_page=False)
    throughput.locator("summary").click()
    expect()(throughput.locator("table tbody tr")).to_have_count(60)
    expect()(throughput.locator("thead")).to_contain_text("emails")
    page.evaluate("localStorage.setItem('theme', 'dark')")
    page.reload()
    expect()(page.locator("html")).to_have_attribute("data-theme", "dark")
    assert axis_colour() != light  # the admin's own colours, for its dark theme
    page.screenshot(path=shots_dir(tmp_path) / "admin-health-charts-dark.png", full_page=False)


# ---- fix, then replay -------------------------------------------------------------------------


def staff_user(django_user_model: Any, name: str, *codenames: str) -> None:
    user = django_user_model.objects.create_user(name, password=PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="pgjobs", codename__in=codenames)
    )


def log_in_as(page: Any, live_server: Any, name: str, path: str) -> None:
    page.goto(f"{live_server.url}/admin/login/?next={path}")
    page.fill("#id_username", name)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")


def test_an_editor_fixes_a_dead_letters_payload_and_replays_it_and_it_succeeds(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    staff_user(django_user_model, "editor", "view_job", "replay_job", "edit_payload_job")
    job = JobFactory(
        dead=True, task="tests.tasks.send_email", queue="emails", payload={"subject": "Receipt"},
        last_error="PayloadMismatch: payload does not fit tests.tasks.send_email(): missing a "
        "required argument: 'to'",
    )  # fmt: skip
    log_in_as(page, live_server, "editor", f"/admin/pgjobs/deadletter/{job.pk}/change/")
    page.get_by_role("link", name="Edit payload and replay…").click()
    editor = page.locator("textarea[name=payload]")
    expect()(editor).to_have_value('{\n  "subject": "Receipt"\n}')

    editor.fill('{"subject": "Receipt", "too": "ada@example.com"}')  # a typo
    page.get_by_role("button", name="Save and replay").click()
    expect()(page.locator(".errorlist")).to_contain_text("missing the required argument 'to'")
    assert Job.objects.get(pk=job.pk).status == Status.FAILED
    page.screenshot(path=shots_dir(tmp_path) / "admin-edit-payload.png")

    page.locator("textarea[name=payload]").fill('{"subject": "Receipt", "to": "ada@example.com"}')
    page.get_by_role("button", name="Save and replay").click()
    expect()(page.locator(".messagelist")).to_contain_text("Payload changed, and the job replayed.")
    expect()(page.locator(".pgjobs-timeline .pgjobs-replay")).to_contain_text("by editor")
    log = LogEntry.objects.get(object_id=str(job.pk))
    assert 'Before: {"subject": "Receipt"}' in log.change_message
    assert '"to": "ada@example.com"' in log.change_message

    test_admin_browser.run_worker_once()
    assert Job.objects.get(pk=job.pk).status == Status.SUCCEEDED


def test_without_the_permission_the_payload_cannot_be_edited(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    staff_user(django_user_model, "replayer", "view_job", "replay_job")
    job = JobFactory(dead=True, task="tests.tasks.send_email", payload={"subject": "Receipt"})
    log_in_as(page, live_server, "replayer", f"/admin/pgjobs/deadletter/{job.pk}/change/")
    expect()(page.get_by_role("button", name="Replay…")).to_be_visible()
    expect()(page.get_by_role("link", name="Edit payload and replay…")).to_have_count(0)
    response = page.goto(f"{live_server.url}/admin/pgjobs/deadletter/{job.pk}/edit-payload/")
    assert response is not None and response.status == 403
    assert Job.objects.get(pk=job.pk).payload == {"subject": "Receipt"}
