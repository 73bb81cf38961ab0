"""Beyond the lists, in a real browser (Debian's Chromium, driven by Playwright): the health
report's charts in the light and dark themes, and fixing a dead letter's payload before replay."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from django_pgjobs.models import QueueStat
from tests.browser import test_admin_browser
from tests.browser.test_admin_operator import expect, log_in

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
    expect()(hour.locator("figure")).to_have_count(4)
    throughput = hour.locator("figure").first
    expect()(throughput.locator("polyline")).to_have_count(2)  # a line per queue
    expect()(throughput.locator("circle title").first).to_contain_text("jobs/min")
    assert "emails · " in throughput.locator("circle title").first.text_content()
    point = throughput.locator("circle").nth(25)
    point.hover()
    expect()(point).to_have_css("fill-opacity", "1")  # shown under the pointer

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
