"""The operator's admin through Django's test client: deletes that refuse running jobs, the
confirmation pages' sentences, cancelling, the replay history, the replay queue warning."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.urls import reverse

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory
from tests.integration.test_admin import JOBS, act, log_for, messages_of, reload

pytestmark = pytest.mark.django_db


def delete_url(job: Job, model: str = "job") -> str:
    return reverse(f"admin:pgjobs_{model}_delete", args=[job.pk])


# ---- delete ---------------------------------------------------------------------------------


def test_a_posted_delete_of_a_running_job_is_refused_and_changes_nothing(admin_client):
    running = JobFactory(running=True)
    response = admin_client.post(delete_url(running), {"post": "yes"}, follow=True)
    assert "cannot be deleted while it runs" in messages_of(response)[0]
    assert response.redirect_chain[-1][0] == reverse("admin:pgjobs_job_change", args=[running.pk])
    assert reload(running).status == Status.RUNNING
    assert not LogEntry.objects.exists()


def test_a_job_that_started_running_after_the_confirmation_page_is_not_deleted(admin_client):
    job = JobFactory()
    page = admin_client.get(delete_url(job))
    assert page.status_code == 200
    Job.objects.claim(["default"], worker="w1", limit=1)  # claimed while the page was open
    response = admin_client.post(delete_url(job), {"post": "yes"}, follow=True)
    assert "cannot be deleted while it runs" in messages_of(response)[0]
    assert reload(job).status == Status.RUNNING and log_for(job) == []


def test_the_job_page_deletes_a_finished_job_through_the_guarded_delete_and_logs_it(
    admin_client, admin_user
):
    job = JobFactory(dead=True)
    response = admin_client.post(delete_url(job), {"post": "yes"}, follow=True)
    assert messages_of(response) == [f"The job “{job}” was deleted successfully."]
    assert not Job.objects.filter(pk=job.pk).exists()
    assert log_for(job) == [(admin_user.username, DELETION, "Deleted.")]


def test_the_running_job_page_offers_cancel_and_no_delete(admin_client):
    running = JobFactory(running=True)
    page = admin_client.get(reverse("admin:pgjobs_job_change", args=[running.pk]))
    assert page.context["has_delete_permission"] is False
    assert [name for name, _ in page.context["job_actions"]] == ["cancel"]


def test_deleting_a_selection_of_running_jobs_reports_them_skipped_as_a_warning(admin_client):
    running, done = JobFactory(running=True), JobFactory(succeeded=True)
    response = act(admin_client, JOBS, "delete_jobs", [running, done])
    assert messages_of(response) == [
        "1 job deleted. 1 skipped: running jobs are not deleted while their worker runs them; "
        "cancel them instead."
    ]
    assert [m.level_tag for m in response.context["messages"]] == ["warning"]
    assert reload(running).status == Status.RUNNING
    assert log_for(running) == []
