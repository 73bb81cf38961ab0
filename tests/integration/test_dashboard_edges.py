"""The jobs dashboard (admin/dashboard.py) at its edges: each number against the list it links
to, hostile and long names, a view-only user, a database user without the rollup, timeouts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.test import override_settings
from django.urls import reverse

from django_pgjobs.conf import get_settings
from tests.factories import JobFactory
from tests.integration.test_admin import staff
from tests.integration.test_commands import as_a_user_who_reads

pytestmark = pytest.mark.django_db

DASHBOARD = reverse("admin:pgjobs_job_dashboard")
HOSTILE_QUEUE = "<script>alert('q')</script>"
HOSTILE_TASK = "x\"><img src=x onerror=alert('t')>"


def test_each_number_links_to_a_list_of_exactly_what_it_counts(admin_client):
    """The module says: "every number a link to the list it counts". Due, scheduled and retrying
    all link to every ready job of the queue."""
    due = Now() - timedelta(seconds=1)
    JobFactory(queue="emails", task="tests.tasks.send_email", run_at=due)
    JobFactory.create_batch(
        3, queue="emails", task="tests.tasks.send_email", run_at=Now() + timedelta(hours=1)
    )
    page = admin_client.get(DASHBOARD)
    emails = next(row for row in page.context["queues"] if row["queue"].queue == "emails")
    wrong = {}
    for state in emails["states"]:
        listed = admin_client.get(state["url"]).context["cl"].result_count
        if listed != state["count"]:
            wrong[state["key"]] = (state["count"], listed)
    assert wrong == {}, "count on the dashboard vs rows its link lists"


def test_hostile_queue_and_task_names_are_escaped(admin_client):
    JobFactory(queue=HOSTILE_QUEUE, task=HOSTILE_TASK, dead=True)
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    content = page.content.decode()
    assert "<script>alert" not in content
    assert "<img src=x" not in content
    emails = next(row for row in page.context["queues"] if row["queue"].queue == HOSTILE_QUEUE)
    for state in emails["states"]:
        assert admin_client.get(state["url"]).status_code == 200


def test_a_very_long_queue_name(admin_client):
    JobFactory(queue="q" * 100, task="t" * 200, dead=True)
    assert admin_client.get(DASHBOARD).status_code == 200


def test_a_view_only_user_sees_the_dashboard():
    JobFactory(queue="emails", dead=True)
    viewer = staff("view_job")
    page = viewer.get(DASHBOARD)
    assert page.status_code == 200


def test_a_database_user_who_cannot_read_the_rollup_still_gets_a_page(admin_client):
    JobFactory(queue="emails", dead=True)
    admin_client.get(DASHBOARD)  # session made
    as_a_user_who_reads(
        "pgjobs_job", "pgjobs_queue", "pgjobs_queuestat", "pgjobs_worker", "django_session",
        "auth_user", "auth_user_groups", "auth_group", "auth_permission",
        "auth_user_user_permissions", "auth_group_permissions", "django_content_type",
        "django_migrations",
    )  # fmt: skip
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    assert "could not be read" in page.content.decode()


def test_an_empty_database_shows_the_dashboard(admin_client):
    page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
    assert "No jobs, queues or workers yet." in page.content.decode()


def test_a_tiny_statement_timeout_gives_a_page_not_a_500(admin_client):
    JobFactory.create_batch(5, queue="emails", dead=True)
    health = {**get_settings().HEALTH, "REPORT_STATEMENT_SECONDS": 0.000001}
    with override_settings(PGJOBS={"HEALTH": health}):
        page = admin_client.get(DASHBOARD)
    assert page.status_code == 200
