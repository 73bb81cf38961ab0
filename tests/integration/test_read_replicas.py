"""Behind a lagging read replica (DATABASE_ROUTERS that read from another database): what
must be asked of the write database, the key an enqueue looks for and a cancellation asked
about."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from django.db import connection, connections

from django_pgjobs.models import Job
from django_pgjobs.runtime import execute


class ReadReplicaRouter:
    """Reads from "replica", a second connection that cannot see the test's uncommitted rows:
    a replica that is behind."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"

    def allow_relation(self, *objects: Any, **hints: Any) -> bool:
        return True


@pytest.fixture
def replica():
    connections.settings["replica"] = copy.deepcopy(connection.settings_dict)
    yield
    connections["replica"].close()
    del connections["replica"]
    del connections.settings["replica"]


@pytest.mark.django_db
def test_a_held_key_is_found_on_the_write_database_behind_a_lagging_read_replica(settings, replica):
    holder = Job.objects.enqueue("tests.tasks.noop", unique_key="invoice-1")
    settings.DATABASE_ROUTERS = [ReadReplicaRouter()]

    again = Job.objects.enqueue("tests.tasks.noop", unique_key="invoice-1")

    assert again.pk == holder.pk


@pytest.mark.django_db
def test_cancel_requested_asks_the_write_database_not_a_lagging_read_replica(settings, replica):
    from django_pgjobs import cancel_requested

    Job.objects.enqueue("tests.tasks.noop")
    (job,) = Job.objects.claim(["default"], worker="w1")
    Job.objects.filter(pk=job.pk).cancel()  # not on the replica yet
    settings.DATABASE_ROUTERS = [ReadReplicaRouter()]

    with execute.running(job):
        assert cancel_requested()
