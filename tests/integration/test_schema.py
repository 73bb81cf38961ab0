"""The invariants the database itself enforces."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("assignment", "constraint"),
    [
        ("status = 'running', leased_until = NULL", "pgjobs_job_running_has_lease"),
        ("status = 'succeeded'", "pgjobs_job_finished_iff_finished_at"),
        ("finished_at = now()", "pgjobs_job_finished_iff_finished_at"),
        # An unknown status breaks both checks; PostgreSQL names whichever it tests first.
        ("status = 'lost'", "pgjobs_job_status_valid|pgjobs_job_finished_iff_finished_at"),
        ("priority = 101", "pgjobs_job_priority_range"),
        ("max_attempts = 0", "pgjobs_job_attempts_valid"),
    ],
)
def test_the_database_refuses_rows_that_break_an_invariant(assignment, constraint):
    job = JobFactory()
    with (
        pytest.raises(IntegrityError, match=constraint),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(f"UPDATE pgjobs_job SET {assignment} WHERE id = %s", [job.pk])


def test_two_live_jobs_cannot_share_a_unique_key_but_finished_ones_can():
    JobFactory(dead=True, unique_key="k")
    JobFactory(unique_key="k")
    with pytest.raises(IntegrityError, match="pgjobs_job_unique_key_live"), transaction.atomic():
        JobFactory(unique_key="k")


def test_ids_are_time_ordered():
    jobs = [JobFactory() for _ in range(20)]
    assert [job.pk for job in jobs] == sorted(job.pk for job in jobs)
    assert {job.pk.version for job in jobs} == {7}


def test_the_queue_storage_settings_are_applied_by_a_migration():
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'pgjobs_job'")
        (options,) = cursor.fetchone()
    assert "autovacuum_vacuum_scale_factor=0.02" in options
    # Room on each page for a job's claim and its heartbeats, so those can be HOT updates.
    assert "fillfactor=70" in options


def test_jobs_without_a_unique_key_take_no_entry_in_the_unique_key_index():
    # Every index entry is paid on every insert and every claim; most jobs have no key.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'pgjobs_job_unique_key_live'"
        )
        (definition,) = cursor.fetchone()
    assert "unique_key IS NOT NULL" in definition
