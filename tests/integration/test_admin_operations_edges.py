"""Large admin actions run as a job (admin/operations.py) at their edges: a batch's members, the
operation cancelled, its own job among the jobs it changes, unique keys, odd query strings."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.urls import reverse

from django_pgjobs.admin import operations
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests.integration.test_admin import JOBS, REPLAY_MATCHING, messages_of
from tests.integration.test_admin_operations import dead_letters, replays_of

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(operations, "LARGE", 20)
    monkeypatch.setattr(operations, "OPERATION_BATCH", 7)


def failed_members(batch: Batch, count: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO pgjobs_job (id, queue, task, payload, status, max_attempts, attempts,
                                    last_error, finished_at, run_at, created_at, batch_id)
            SELECT gen_random_uuid(), 'parked', 'tests.tasks.noop', '{}', 'failed', 3, 3,
                   'ConnectionError: Connection refused', now() - interval '1 minute',
                   now() - interval '2 minutes', now() - interval '2 minutes', %s
            FROM generate_series(1, %s)
            """,
            [batch.pk, count],
        )


def test_replay_failed_members_of_a_large_batch_replays_them(admin_client):
    """A batch's "Replay failed members" is not a list's "all matching": it replays in the
    request, however many (it once went to an operation that rebuilt the Batches list)."""
    batch = Batch.objects.create(size=30)
    failed_members(batch, 30)
    url = reverse("admin:pgjobs_batch_replay_failed", args=[batch.pk])
    response = admin_client.post(url, {"post": "yes"}, follow=True)
    assert messages_of(response) == ["30 jobs replayed."]
    assert not Job.objects.filter(task="django_pgjobs.operate").exists()
    assert Job.objects.filter(batch=batch, status=Status.READY).count() == 30


@pytest.mark.django_db(transaction=True)
def test_cancelling_the_operation_itself_stops_it(admin_client, monkeypatch):
    """An operator who sees a large operation going wrong cancels its job: the operation never
    asks cancel_requested(), so it carries on to the end and succeeds."""
    dead_letters(50)
    admin_client.post(REPLAY_MATCHING, {"post": "yes"})
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    real = operations.progress
    calls: list[Any] = []

    def progress_then_cancelled(done: float, total: float | None = None) -> None:
        real(done, total)
        if not calls:  # the operator presses Cancel on the job's page after the first batch
            Job.objects.filter(pk=operation.pk).cancel()
        calls.append(done)

    monkeypatch.setattr(operations, "progress", progress_then_cancelled)
    monkeypatch.setattr("django_pgjobs.runtime.execute.CHECK_INTERVAL", 0)
    run_jobs(tasks=[operations.operate])
    operation.refresh_from_db()
    assert operation.status == Status.CANCELLED
    assert sum(replays_of()) < 50  # it stopped before the end


def test_cancel_all_jobs_does_not_cancel_its_own_operation(admin_client):
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, created_at) "
            "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3, "
            "now() - interval '1 minute' FROM generate_series(1, 40)"
        )
    data = {"action": "cancel", "select_across": "1", "index": "0", "post": "yes",
            "_selected_action": [str(Job.objects.first().pk)]}  # fmt: skip
    admin_client.post(JOBS, data)
    run_jobs(tasks=[operations.operate])
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    assert operation.status == Status.SUCCEEDED
    assert not operation.cancel_requested
    assert Job.objects.filter(task="tests.tasks.noop", status=Status.CANCELLED).count() == 40


def test_replay_of_dead_letters_sharing_a_unique_key_terminates_with_full_progress(admin_client):
    dead_letters(40)
    Job.objects.filter(queue="parked").update(unique_key="same")
    admin_client.post(REPLAY_MATCHING, {"post": "yes"})
    run_jobs(tasks=[operations.operate])
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    assert operation.status == Status.SUCCEEDED
    assert operation.progress["done"] == operation.progress["total"] == 40
    assert sorted(replays_of()) == [0] * 39 + [1]


@pytest.mark.parametrize(
    "query",
    [
        "o=-3.1&p=3&task=tests.tasks.noop",
        "q=noop&all=1",
        "q=%00",
        "status__exact=failed&worker=w1",
        "status__exact=stuck",
        "batch=00000000-0000-0000-0000-000000000000",
    ],
)
def test_odd_query_strings_rebuild_the_list_the_user_saw(admin_client, query):
    dead_letters(30)
    url = f"{JOBS}?{query}"
    shown = admin_client.get(url)
    if shown.status_code != 200:
        pytest.skip(f"list refused: {shown.status_code}")
    seen = shown.context["cl"].queryset.count()
    ids = [str(j.pk) for j in Job.objects.all()[:1]]
    data = {"action": "delete_jobs", "select_across": "1", "index": "0", "post": "yes",
            "_selected_action": ids}  # fmt: skip
    admin_client.post(url, data)
    operation = Job.objects.filter(task="django_pgjobs.operate").first()
    if seen <= operations.LARGE:
        assert operation is None
        return
    run_jobs(tasks=[operations.operate])
    operation.refresh_from_db()
    assert operation.status == Status.SUCCEEDED, operation.last_error
    assert Job.objects.filter(queue="parked").count() == 30 - seen
