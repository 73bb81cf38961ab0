"""A large replay from the admin carried out by a real `runjobs` process, SIGKILLed midway
(admin/operations.py): the request returns at once; another worker takes the operation up once
its lease has run out and finishes it, every dead letter replayed exactly once."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.crash.conftest import start_worker  # noqa: F401  (a fixture)
from tests.integration.test_admin_operations import dead_letters

pytestmark = pytest.mark.django_db(transaction=True)

DEAD_LETTERS = 50_000


def replays() -> dict[int, int]:
    """How many dead letters were replayed how many times, by their error histories."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n, count(*) FROM (SELECT count(e) FILTER (WHERE e ? 'replayed_at') AS n "
            "FROM pgjobs_job AS j LEFT JOIN LATERAL jsonb_array_elements(j.errors) AS e ON true "
            "WHERE j.queue = 'parked' GROUP BY j.id) AS per_job GROUP BY n"
        )
        return dict(cursor.fetchall())


def test_a_replay_of_every_dead_letter_survives_its_worker_killed_midway(
    start_worker: Any,  # noqa: F811
) -> None:
    dead_letters(DEAD_LETTERS)
    client = Client()
    client.force_login(User.objects.create_superuser("operator", password="pw"))
    response = client.post(reverse("admin:pgjobs_deadletter_replay_matching"), {"post": "yes"})
    (operation,) = Job.objects.filter(task="django_pgjobs.operate")
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:pgjobs_job_change", args=[operation.pk])

    doomed = start_worker("--queue", "default", "--lease", "3")

    def midway() -> bool:
        operation.refresh_from_db()
        done = (operation.progress or {}).get("done", 0)
        return 0 < done < DEAD_LETTERS

    assert wait_until(midway, 60, interval=0.02), operation.progress
    doomed.signal(signal.SIGKILL)
    doomed.wait(10)
    operation.refresh_from_db()
    assert operation.status == Status.RUNNING
    left = Job.objects.filter(queue="parked", status=Status.FAILED).count()
    assert 0 < left < DEAD_LETTERS

    start_worker("--queue", "default", "--lease", "3")
    assert wait_until(
        lambda: Job.objects.get(pk=operation.pk).status == Status.SUCCEEDED, 120, interval=0.2
    )
    operation.refresh_from_db()
    assert operation.attempts == 2  # taken up again after the kill
    assert operation.progress["done"] == operation.progress["total"] == DEAD_LETTERS
    assert replays() == {1: DEAD_LETTERS}  # every one, once
    assert LogEntry.objects.count() == 1
