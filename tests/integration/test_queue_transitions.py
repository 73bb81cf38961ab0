"""Queue.objects' transitions (django_pgjobs.data.queues) against the real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_pgjobs.models import Queue

pytestmark = pytest.mark.django_db


def test_pause_changes_only_running_queues_and_returns_their_names():
    for name in ("emails", "reports", "done"):
        Queue.objects.create(name=name)
    Queue.objects.filter(name="done").update(paused=True)
    assert sorted(Queue.objects.all().pause()) == ["emails", "reports"]
    assert Queue.objects.paused().count() == 3
    assert Queue.objects.all().pause() == []


def test_resume_changes_only_paused_queues_of_the_selection():
    for name in ("emails", "reports"):
        Queue.objects.create(name=name, paused=True)
    assert Queue.objects.filter(name="emails").resume() == ["emails"]
    assert list(Queue.objects.paused().values_list("name", flat=True)) == ["reports"]


def test_pause_and_resume_stamp_updated_at():
    Queue.objects.create(name="emails")
    Queue.objects.update(updated_at=Now() - timedelta(days=1))
    before = Queue.objects.get().updated_at
    Queue.objects.all().pause()
    paused = Queue.objects.get().updated_at
    Queue.objects.all().resume()
    assert before < paused <= Queue.objects.get().updated_at


def test_an_empty_selection_changes_nothing():
    Queue.objects.create(name="emails")
    assert Queue.objects.none().pause() == []
    assert not Queue.objects.get().paused
