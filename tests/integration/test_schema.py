"""The invariants the database itself enforces."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from django_pgjobs.models import Job
from tests.conftest import wait_until
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
    assert "fillfactor=55" in options


def hot_updates() -> tuple[int, int]:
    """The job table's updates so far, and how many of them were HOT."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'"
        )
        updates, hot = cursor.fetchone()
    return int(updates), int(hot)


@pytest.mark.django_db(transaction=True)  # the statistics count committed work
def test_the_heartbeats_of_a_batch_claimed_at_once_are_hot_updates():
    """A heartbeat is HOT when its row's page has room: the fillfactor's (70 left it for 63%
    of them), and what pruning the versions the claim replaced gives back, which any
    transaction older than the claim puts off, in any database of the cluster (with one open:
    25%, as CI met while its other leg ran). Later heartbeats need pruning too: measured by the
    benchmark on its quiet cluster (97% over three), not here."""
    with connection.cursor() as cursor:  # no ANALYZE of its own starts in the middle
        cursor.execute("ALTER TABLE pgjobs_job SET (autovacuum_enabled = off)")
    try:
        Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 1000)
        claimed = Job.objects.claim(["default"], worker="w1", limit=1000, lease=300)
        # The enqueued versions the claim replaced can be pruned once no transaction older
        # than the claim is open, in any database of the cluster (one that is, an
        # autovacuum's ANALYZE or another test's snapshot, is waited out: what is measured is
        # the table's room, not the machine's timing).
        after_claim = marker_xid()
        try:
            wait_until(lambda: not older_transactions(after_claim), timeout=90, interval=0.05)
        except AssertionError:
            held = older_transactions(after_claim)
            raise AssertionError(f"transactions older than the claim: {held}") from None
        before = hot_updates()
        Job.objects.heartbeat(claimed, 300)
        after = hot_updates()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pgjobs_job RESET (autovacuum_enabled)")
    assert after[0] - before[0] == 1000
    assert (after[1] - before[1]) / 1000 >= 0.85


def marker_xid() -> str:
    """A transaction id newer than every transaction committed so far (one of its own)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT (txid_current() % 4294967296)::text")
        return str(cursor.fetchone()[0])


def older_transactions(than: str) -> list[tuple[str, ...]]:
    """Other sessions, in any database, whose transaction or snapshot predates `than`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT datname, backend_type, application_name, state, left(query, 60) "
            "FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND greatest(age(backend_xid), age(backend_xmin)) > age(%s::xid)",
            [than],
        )
        return cursor.fetchall()
