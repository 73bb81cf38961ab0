"""Large admin actions run as a job (admin/operations.py): the request enqueues it and logs once;
the job changes the jobs the list matched, a batch a transaction, with its progress."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection
from django.urls import reverse

from django_pgjobs.admin import operations
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests.integration.test_admin import DEAD, JOBS, REPLAY_MATCHING, messages_of, staff

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "Large" from 20 jobs, 7 a transaction: the same paths, quicker."""
    monkeypatch.setattr(operations, "LARGE", 20)
    monkeypatch.setattr(operations, "OPERATION_BATCH", 7)


def dead_letters(count: int, task: str = "tests.tasks.noop", queue: str = "parked") -> None:
    """`count` dead letters, finished a minute ago, in a queue no test serves."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO pgjobs_job (id, queue, task, payload, status, max_attempts, attempts,
                                    last_error, finished_at, run_at, created_at)
            SELECT gen_random_uuid(), %s, %s, '{}', 'failed', 3, 3,
                   'ConnectionError: Connection refused', now() - interval '1 minute',
                   now() - interval '2 minutes', now() - interval '2 minutes'
            FROM generate_series(1, %s)
            """,
            [queue, task, count],
        )


def replays_of(job_ids: Any = None) -> list[int]:
    """How many times each dead letter was replayed, by its error history."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(e) FILTER (WHERE e ? 'replayed_at') FROM pgjobs_job AS j "
            "LEFT JOIN LATERAL jsonb_array_elements(j.errors) AS e ON true "
            "WHERE j.queue = 'parked' GROUP BY j.id"
        )
        return sorted(n for (n,) in cursor.fetchall())


def test_replaying_all_matching_past_large_enqueues_one_job_and_logs_once(admin_client):
    dead_letters(50)
    dead_letters(3, task="tests.tasks.send_email")  # filtered out
    url = f"{REPLAY_MATCHING}?task=tests.tasks.noop"
    asked = admin_client.post(url)
    assert "changed by a job of the queue" in asked.content.decode()
    response = admin_client.post(url, {"post": "yes"}, follow=True)
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    assert response.redirect_chain[-1][0] == reverse("admin:pgjobs_job_change", args=[operation.pk])
    assert messages_of(response)[0] == (
        "50 jobs: “Replay jobs” runs as a job; this page shows its progress."
    )
    assert Job.objects.filter(status=Status.FAILED).count() == 53  # nothing changed yet
    (entry,) = LogEntry.objects.all()
    assert entry.object_id == str(operation.pk)
    assert "50 jobs matching task=tests.tasks.noop" in entry.get_change_message()

    run_jobs(tasks=[operations.operate])
    operation.refresh_from_db()
    assert operation.status == Status.SUCCEEDED
    assert operation.progress["done"] == operation.progress["total"] == 50
    assert Job.objects.filter(task="tests.tasks.noop", status=Status.READY).count() == 50
    assert Job.objects.filter(task="tests.tasks.send_email", status=Status.FAILED).count() == 3
    assert replays_of() == [0] * 3 + [1] * 50
    assert LogEntry.objects.count() == 1


def test_a_second_run_replays_nothing_twice_not_even_a_job_that_failed_again(admin_client):
    dead_letters(30)
    admin_client.post(REPLAY_MATCHING, {"post": "yes"})
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    run_jobs(tasks=[operations.operate])
    # One of them failed again since; then the operation ran again (a worker lost it).
    again = Job.objects.filter(queue="parked").first()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET status = 'failed', "
            "finished_at = statement_timestamp() + interval '1 second' WHERE id = %s",
            [again.pk],
        )
    operations.operate.func(**operation.payload)
    assert replays_of() == [1] * 30


def test_selecting_all_and_cancelling_runs_as_a_job_and_spares_jobs_enqueued_since(admin_client):
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, created_at) "
            "SELECT gen_random_uuid(), 'parked', 'tests.tasks.noop', '{}', 3, "
            "now() - interval '1 minute' FROM generate_series(1, 40)"
        )
    data = {"action": "cancel", "select_across": "1", "index": "0", "post": "yes",
            "_selected_action": [str(Job.objects.first().pk)]}  # fmt: skip
    response = admin_client.post(f"{JOBS}?queue=parked", data, follow=True)
    assert "runs as a job" in messages_of(response)[0]
    later = Job.objects.enqueue("tests.tasks.noop", {}, queue="parked")
    run_jobs(tasks=[operations.operate])
    assert Job.objects.filter(queue="parked", status=Status.CANCELLED).count() == 40
    assert Job.objects.get(pk=later.pk).status == Status.READY


def test_ticked_rows_stay_in_the_request_however_many(admin_client):
    dead_letters(25)
    jobs = list(Job.objects.filter(queue="parked"))
    data = {"action": "replay", "post": "yes", "_selected_action": [str(j.pk) for j in jobs]}
    response = admin_client.post(DEAD, data, follow=True)
    assert messages_of(response) == ["25 jobs replayed."]
    assert not Job.objects.filter(task="django_pgjobs.operate").exists()


def test_the_operation_refuses_a_user_no_longer_allowed(admin_client):
    dead_letters(30)
    viewer = staff("view_job", "view_deadletter", "replay_job")
    viewer.post(REPLAY_MATCHING, {"post": "yes"})
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    from django.contrib.auth.models import Permission, User

    User.objects.get(pk=operation.payload["user"]).user_permissions.remove(
        Permission.objects.get(codename="replay_job")
    )
    run_jobs(tasks=[operations.operate])
    operation.refresh_from_db()
    assert operation.status == Status.FAILED and "may no longer replay" in operation.last_error
    assert replays_of() == [0] * 30


def test_an_edited_payload_cannot_name_another_queryset_method(admin_client):
    # A payload can be edited (with its own permission) before a replay: the operation carries
    # out only the admin's four transitions, each with its own permission checked.
    dead_letters(30)
    admin_client.post(REPLAY_MATCHING, {"post": "yes"})
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    with pytest.raises(PermissionError, match="'delete' is not an operation"):
        operations.operate.func(**{**operation.payload, "transition": "delete"})
    assert replays_of() == [0] * 30
