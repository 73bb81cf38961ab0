"""Fix, then replay: editing a failed job's payload before replaying it, through the test
client: the permission it needs, the checks enqueue makes, the admin log's before and after."""

from __future__ import annotations

import html
import json

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.urls import reverse

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory
from tests.integration.test_admin import log_for, messages_of, reload, staff

pytestmark = pytest.mark.django_db

EDITORS = ("view_job", "replay_job", "edit_payload_job")


def edit_url(job: Job, model: str = "deadletter") -> str:
    return reverse(f"admin:pgjobs_{model}_edit_payload", args=[job.pk])


def page_url(job: Job, model: str = "deadletter") -> str:
    return reverse(f"admin:pgjobs_{model}_change", args=[job.pk])


def post(client, job, payload, model="deadletter"):  # type: ignore[no-untyped-def]
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return client.post(edit_url(job, model), {"payload": text}, follow=True)


def test_an_editor_corrects_a_missing_argument_and_the_job_is_replayed_and_logged():
    job = JobFactory(dead=True, task="tests.tasks.send_email", payload={"subject": "Hi"},
                     last_error="PayloadMismatch: missing a required argument: 'to'")  # fmt: skip
    editor = staff(*EDITORS)
    assert edit_url(job) in editor.get(page_url(job)).content.decode()  # the page offers it
    form = editor.get(edit_url(job))
    assert '"subject": "Hi"' in html.unescape(form.content.decode())

    response = post(editor, job, {"to": "ada@example.com", "subject": "Hi"})
    assert messages_of(response) == ["Payload changed, and the job replayed."]
    assert response.redirect_chain[-1][0] == page_url(job, "job")
    row = reload(job)
    assert (row.status, row.payload) == (Status.READY, {"to": "ada@example.com", "subject": "Hi"})
    assert row.errors[-1]["by"] == "staff-view_job-replay_job-edit_payload_job"
    ((_, flag, message),) = log_for(job)
    assert flag == CHANGE
    assert message == (
        'Payload edited, then replayed. Before: {"subject": "Hi"} '
        'After: {"subject": "Hi", "to": "ada@example.com"}'
    )
    assert LogEntry.objects.get().get_admin_url() == reverse(
        "admin:pgjobs_job_change", args=[job.pk]
    )


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ('{"to": "x"', "Not valid JSON"),
        ("[1, 2]", "payload must be a JSON object"),
        ('{"to": NaN}', "NaN is not JSON"),
        (
            {"subject": "no recipient"},
            "the payload does not fit tests.tasks.send_email(to, subject=''): missing the "
            "required argument 'to'",
        ),
        ({"to": "x", "cc": "y"}, "unexpected argument 'cc'"),
        ({"to": "x\u0000"}, "\\u0000"),
        ({"to": "x" * 1_000_000}, "over the limit of 1,000,000"),
    ],
)
def test_a_payload_enqueue_or_the_handler_would_refuse_is_refused_and_nothing_changes(
    payload, error
):
    job = JobFactory(dead=True, task="tests.tasks.send_email", payload={"subject": "Hi"})
    response = post(staff(*EDITORS), job, payload)
    assert response.status_code == 200
    assert error in html.unescape(response.content.decode())
    row = reload(job)
    assert (row.status, row.payload) == (Status.FAILED, {"subject": "Hi"})
    assert not LogEntry.objects.exists()


def test_a_payload_saved_unchanged_replays_the_job_and_does_not_say_it_changed():
    job = JobFactory(dead=True, task="tests.tasks.send_email",
                     payload={"to": "ada@example.com", "subject": "Hi"})  # fmt: skip
    response = post(staff(*EDITORS), job, {"subject": "Hi", "to": "ada@example.com"})
    assert messages_of(response) == ["The job replayed, its payload unchanged."]
    assert reload(job).status == Status.READY


def test_redacted_keys_keep_their_value_and_stay_hidden_in_the_form_and_the_log():
    job = JobFactory(dead=True, task="custom.name", payload={"password": "s3cret", "user": 1})
    editor = staff(*EDITORS)
    form = editor.get(edit_url(job)).content.decode()
    assert "s3cret" not in form and "[redacted]" in form
    post(editor, job, {"password": "[redacted]"})
    assert reload(job).payload == {"password": "s3cret"}
    assert "s3cret" not in log_for(job)[0][2]


@pytest.mark.parametrize(
    "codenames",
    [("view_job", "replay_job"), ("view_job", "edit_payload_job"), ("view_job",)],
)
def test_without_both_permissions_there_is_no_button_and_the_page_is_refused(codenames):
    job = JobFactory(dead=True, task="tests.tasks.send_email", payload={})
    user = staff(*codenames)
    assert "edit-payload" not in user.get(page_url(job)).content.decode()
    assert user.get(edit_url(job)).status_code == 403
    assert post(user, job, {"to": "x"}).status_code == 403
    assert (reload(job).status, reload(job).payload) == (Status.FAILED, {})
    assert not LogEntry.objects.exists()


def test_only_a_failed_or_cancelled_job_can_have_its_payload_edited():
    running = JobFactory(running=True, task="tests.tasks.send_email", payload={})
    editor = staff(*EDITORS)
    assert "edit-payload" not in editor.get(page_url(running, "job")).content.decode()
    response = post(editor, running, {"to": "x"}, model="job")
    assert messages_of(response) == ["Only a failed or cancelled job's payload can be edited."]
    assert reload(running).payload == {}


def test_when_replay_would_not_take_the_job_the_payload_is_not_changed_either():
    JobFactory(unique_key="order-9")  # a live job holds the key
    dead = JobFactory(dead=True, task="tests.tasks.send_email", payload={}, unique_key="order-9")
    response = post(staff(*EDITORS), dead, {"to": "x"})
    assert "Nothing changed: the job was not replayed" in html.unescape(response.content.decode())
    assert (reload(dead).status, reload(dead).payload) == (Status.FAILED, {})
    assert not LogEntry.objects.exists()


def test_a_job_of_an_unregistered_task_is_not_offered_the_payload_edit_and_says_why():
    job = JobFactory(dead=True, task="shop.tasks.retired", payload={})
    editor = staff(*EDITORS)
    content = html.unescape(editor.get(page_url(job)).content.decode())
    assert edit_url(job) not in content
    assert 'title="The task shop.tasks.retired is not registered here, so its payload' in content
    response = editor.get(edit_url(job), follow=True)
    assert response.redirect_chain == [(page_url(job), 302)]
    assert messages_of(response) == [
        "The task shop.tasks.retired is not registered here, so its payload cannot be checked."
    ]


def test_a_corrected_job_of_a_nats_queue_is_said_handed_to_its_stream_and_leads_to_the_list(
    settings,
):
    settings.PGJOBS = {**settings.PGJOBS, "QUEUES": {"events": {"TRANSPORT": "nats"}}}
    job = JobFactory(dead=True, task="tests.tasks.send_email", payload={}, queue="events")
    response = post(staff(*EDITORS), job, {"to": "ada@example.com"})
    assert response.redirect_chain == [(reverse("admin:pgjobs_job_changelist"), 302)]
    assert messages_of(response) == [
        "Payload changed, and the job replayed. 1 went to NATS JetStream (PGJOBS_events): its "
        "row leaves the job table once relayed."
    ]
