"""A real browser (Debian's Chromium, driven by Playwright) through the dead-letter workflow."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# The docs' screenshots are refreshed only on request (PGJOBS_SCREENSHOTS=1), so a test run
# leaves the working tree clean.
SCREENSHOTS = ROOT / "docs" / "_static"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            "the browser test needs Debian's Chromium at /usr/bin/chromium "
            "(apt-get install chromium); it never downloads a browser"
        )
    sync_api = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API keeps an event loop running in this thread; the test's own ORM
    # calls are still plain synchronous code. With a loop running, Django keeps this thread's
    # connections apart from the ones it had before, so they are closed here, before the
    # test database is dropped.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        page.set_default_timeout(15_000)
        yield page
        browser.close()
        connections.close_all()


def run_worker_once() -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PGJOBS_TEST_DATABASE": connection.settings_dict["NAME"],
    }
    subprocess.run(
        [sys.executable, "manage.py", "runjobs", "--once", "--queue", "default",
         "--queue", "emails"],
        cwd=ROOT, env=env, check=True, timeout=60, capture_output=True,
    )  # fmt: skip


def dead_letters() -> Job:
    """A few realistic dead letters; returns the one the operator replays."""
    history = [
        {"attempt": n, "at": f"2026-03-02T09:1{n}:07.52Z", "worker": "web-1:4182:2",
         "type": "smtplib.SMTPServerDisconnected", "message": "Connection unexpectedly closed",
         "traceback": 'Traceback (most recent call last):\n  File "shop/tasks.py", line 31, in '
         "send_email\n    smtp.send_message(message)\nsmtplib.SMTPServerDisconnected: "
         "Connection unexpectedly closed\n"}
        for n in (1, 2, 3)
    ]  # fmt: skip
    error = "smtplib.SMTPServerDisconnected: Connection unexpectedly closed"
    JobFactory(
        dead=True, task="custom.name", payload={"password": "s3cret", "user": 12},
        last_error="KeyError: 'user'", errors=[{**history[0], "type": "KeyError",
        "message": "'user'"}], max_attempts=1, attempts=1,
    )  # fmt: skip
    JobFactory(
        dead=True, task="tests.tasks.send_email", queue="emails", errors=history,
        payload={"to": "grace@example.com", "subject": "Your receipt"}, last_error=error,
    )  # fmt: skip
    return JobFactory(  # type: ignore[no-any-return]
        dead=True, task="tests.tasks.send_email", queue="emails", errors=history,
        payload={"to": "ada@example.com", "subject": "Welcome"}, last_error=error,
    )  # fmt: skip


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    """Whether two bounding boxes share any area."""
    return (
        a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]
    )  # fmt: skip


def test_the_dead_letters_list_shows_each_final_error_on_a_1280_pixel_screen(
    page: Any, live_server: Any, django_user_model: Any
) -> None:
    """With Django's navigation sidebar open, a long dotted task name breaks after its dots
    and the error's class is shown without its module path, so the error column is on the
    screen and says something."""
    from playwright.sync_api import expect

    django_user_model.objects.create_superuser("operator", "ops@example.com", "correct-horse")
    JobFactory(
        dead=True, last_error="RuntimeError: 503",
        task="send_the_quarterly_vat_report_to_every_customer_in_the_european_union_now",
    )  # fmt: skip
    JobFactory.create_batch(  # newer: listed first
        3, dead=True, task="example_project.shop.tasks.issue_invoice",
        last_error="django_pgjobs.errors.PermanentError: order 200: no VAT rate for 'UK'",
    )  # fmt: skip
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{live_server.url}/admin/login/?next=/admin/pgjobs/deadletter/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "correct-horse")
    page.click("input[type=submit]")
    error = page.locator("#result_list td.field-final_error").first
    expect(error).to_contain_text("PermanentError: order 200")
    box = error.bounding_box()
    results = page.locator("#changelist .results").bounding_box()
    assert box is not None and results is not None
    assert box["x"] + box["width"] <= results["x"] + results["width"] + 1  # not scrolled away
    assert box["width"] >= 120
    title = error.locator(".pgjobs-error").get_attribute("title")
    assert title == "django_pgjobs.errors.PermanentError: order 200: no VAT rate for 'UK'"
    # A long task name without dots wraps too, in the list and in the summary above it, which
    # stays within the page and clear of the object tools' buttons (Django 5.2 floats them up
    # over the content; Django 6 puts them beside the title).
    summary = page.locator(".pgjobs-summary").bounding_box()
    tools = page.locator("ul.object-tools").bounding_box()
    content = page.locator("#content").bounding_box()
    assert summary is not None and tools is not None and content is not None
    assert summary["x"] + summary["width"] <= content["x"] + content["width"] + 1
    assert not overlap(tools, summary), (tools, summary)
    for cell in page.locator("#result_list td.field-final_error").all():
        box = cell.bounding_box()
        assert box is not None and box["x"] + box["width"] <= results["x"] + results["width"] + 1


def test_an_operator_inspects_a_dead_letter_replays_it_and_sees_it_succeed(
    page: Any, live_server: Any, django_user_model: Any, tmp_path: Path
) -> None:
    shots = SCREENSHOTS if os.environ.get("PGJOBS_SCREENSHOTS") else tmp_path
    from playwright.sync_api import expect

    django_user_model.objects.create_superuser("operator", "ops@example.com", "correct-horse")
    job = dead_letters()

    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "correct-horse")
    page.click("input[type=submit]")
    page.get_by_role("link", name="Dead letters").click()
    expect(page.locator(".pgjobs-summary")).to_contain_text("SMTPServerDisconnected")
    page.screenshot(path=shots / "admin-dead-letters.png", full_page=True)

    page.get_by_role("link", name=job.short_id).click()
    expect(page.locator(".field-payload_display")).to_contain_text("ada@example.com")
    page.locator(".pgjobs-timeline summary").last.click()
    expect(page.locator(".pgjobs-timeline details").last).to_contain_text("send_message")
    page.screenshot(path=shots / "admin-dead-letter-detail.png", full_page=True)

    page.get_by_role("button", name="Replay…").click()
    expect(page.locator(".pgjobs-count")).to_have_text("Replay 1 job?")
    page.screenshot(path=shots / "admin-replay-confirm.png")
    page.get_by_role("button", name="Yes, I’m sure").click()
    expect(page.locator(".messagelist")).to_contain_text("1 job replayed.")

    run_worker_once()

    page.goto(f"{live_server.url}/admin/pgjobs/job/?q={job.short_id}")
    expect(page.locator("#result_list .field-status")).to_have_text("succeeded")
    page.screenshot(path=shots / "admin-job-succeeded.png")
    assert Job.objects.get(pk=job.pk).status == Status.SUCCEEDED
