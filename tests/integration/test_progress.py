"""Progress reports: kept in memory by progress(), written by the lease keeper with the claim's
guard (at most one statement a round, HOT, never waiting on a locked row), written with the
outcome, cleared by the next claim, and sent as a signal."""

from __future__ import annotations

import contextvars
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from django_pgjobs import progress
from django_pgjobs.data.records import Failure
from django_pgjobs.models import Job
from django_pgjobs.runtime import execute
from django_pgjobs.runtime.leases import LeaseKeeper
from django_pgjobs.runtime.sessions import LockWaits
from django_pgjobs.signals import job_progress
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import framework_tasks
from tests.factories import JobFactory
from tests.integration.test_admin import JOBS, detail, staff
from tests.integration.test_transitions import claim_one, expire_leases

pytestmark = pytest.mark.django_db


def database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        now: datetime = cursor.fetchone()[0]
    return now


def stored(job: Job) -> Any:
    return Job.objects.values_list("progress", flat=True).get(pk=job.pk)


def keeper(claims: list[Job]) -> LeaseKeeper:
    return LeaseKeeper(Job.objects, lambda: claims, lambda job: 30.0, 30.0, LockWaits("default"))


def test_a_report_stays_in_memory_until_the_heartbeat_writes_it_with_the_database_clock(
    django_assert_num_queries: Any,
) -> None:
    JobFactory()
    job = claim_one()
    with execute.running(job), django_assert_num_queries(0):
        progress(3, 10, note="invoice 3")
    assert job.progress == {"done": 3, "total": 10, "note": "invoice 3"}
    assert stored(job) is None

    before = database_now()
    assert Job.objects.heartbeat([job]) == {job.pk}
    after = database_now()
    row = stored(job)
    assert {key: row[key] for key in ("done", "total", "note")} == job.progress
    assert before <= datetime.fromisoformat(row["at"]) <= after


def test_an_unchanged_report_keeps_the_time_it_was_first_written() -> None:
    JobFactory()
    job = claim_one()
    with execute.running(job):
        progress(3, 10)
    Job.objects.heartbeat([job])
    first = stored(job)["at"]
    with execute.running(job):
        progress(3, 10)  # the same report again: still stuck at 3
    Job.objects.heartbeat([job])
    assert stored(job)["at"] == first
    with execute.running(job):
        progress(4, 10)
    Job.objects.heartbeat([job])
    assert stored(job)["at"] > first


def test_a_stale_claim_cannot_write_its_progress_over_the_new_attempt() -> None:
    JobFactory()
    stale = claim_one("slow-worker")
    expire_leases()
    Job.objects.reap()
    Job.objects.filter(pk=stale.pk).update(run_at=stale.run_at)
    fresh = claim_one("fresh-worker")
    with execute.running(fresh):
        progress(1, 10, note="fresh")
    Job.objects.heartbeat([fresh])

    with execute.running(stale):
        progress(9, 10, note="stale")
    assert Job.objects.heartbeat([stale]) == set()
    assert Job.objects.complete(stale) is False
    assert stored(fresh)["note"] == "fresh"


def test_the_outcome_writes_the_last_report_and_the_next_claim_clears_it() -> None:
    JobFactory(max_attempts=3)
    job = claim_one()
    with execute.running(job):
        progress(7, 10, note="row 7")
    Job.objects.fail(job, Failure("RuntimeError", "boom"), permanent=False, delay=0)
    assert stored(job)["note"] == "row 7"  # where the failed attempt got to

    again = claim_one()
    assert again.progress is None and stored(again) is None
    with execute.running(again):
        progress(10, 10, note="all rows")
    assert Job.objects.complete(again) is True
    assert stored(again)["done"] == 10


def test_a_retry_or_a_release_writes_the_last_report_like_any_outcome() -> None:
    JobFactory.create_batch(2)
    retried, released = Job.objects.claim(["default"], worker="w1", limit=2)
    for job, note in ((retried, "rate limited at 1,204"), (released, "stopped at 40")):
        with execute.running(job):
            progress(40, 100, note=note)  # reported, and not yet written by a heartbeat

    assert Job.objects.retry_later(retried, 600) is True  # the handler raised Retry
    assert Job.objects.release([released]) == {released.pk}  # its worker stopped

    assert stored(retried)["note"] == "rate limited at 1,204"
    assert stored(released)["note"] == "stopped at 40"
    again = Job.objects.claim(["default"], worker="w2")
    assert [job.pk for job in again] == [released.pk] and stored(released) is None


def test_run_jobs_runs_handlers_that_report_and_keeps_the_last_report() -> None:
    received: list[dict[str, Any]] = []

    def receiver(sender: Any, job: Job, **kwargs: Any) -> None:
        received.append({"job": job.pk, **{k: kwargs[k] for k in ("done", "total", "note")}})

    job_progress.connect(receiver)
    try:
        job = Job.objects.enqueue("tests.tasks.reports_progress", {"steps": 3})
        run = run_jobs()
    finally:
        job_progress.disconnect(receiver)
    assert run.counts == {Status.SUCCEEDED: 1}
    assert stored(job)["note"] == "step 3 of 3"
    assert [r["done"] for r in received] == [1, 2, 3]
    assert received[-1] == {"job": job.pk, "done": 3, "total": 3, "note": "step 3 of 3"}


def test_async_handlers_and_django_tasks_report_for_their_job_too() -> None:
    job = Job.objects.enqueue("tests.tasks.reports_progress_async", {"steps": 2})
    framework = framework_tasks.reports_progress_async.enqueue(steps=3)
    assert run_jobs().counts == {Status.SUCCEEDED: 2}
    assert stored(job)["note"] == "async step 2"
    framework_job = Job.objects.get(pk=framework.id)
    assert {k: framework_job.progress[k] for k in ("done", "total")} == {"done": 3, "total": 3}


def test_ten_thousand_reports_cost_no_query_and_one_write(
    django_assert_num_queries: Any,
) -> None:
    JobFactory()
    job = claim_one()
    with execute.running(job), django_assert_num_queries(0):
        for done in range(10_001):
            progress(done, 10_000, note=f"item {done}")
    lease_keeper = keeper([job])
    with django_assert_num_queries(1):
        lease_keeper.keep_up([job], heartbeat=False)
    assert stored(job)["done"] == 10_000
    with django_assert_num_queries(0):  # nothing new: no statement
        lease_keeper.keep_up([job], heartbeat=False)


def test_a_hundred_jobs_new_reports_are_written_in_one_statement(
    django_assert_num_queries: Any,
) -> None:
    JobFactory.create_batch(100)
    jobs = Job.objects.claim(["default"], worker="w1", limit=100)
    for n, job in enumerate(jobs):
        with execute.running(job):
            progress(n, 100, note=f"job {n} " + "x" * 190)
    with django_assert_num_queries(1):
        keeper(jobs).keep_up(jobs, heartbeat=False)
    assert sorted(Job.objects.values_list("progress__done", flat=True)) == list(range(100))


def test_between_heartbeats_only_the_jobs_with_new_reports_are_written() -> None:
    JobFactory.create_batch(2)
    quiet, busy = Job.objects.claim(["default"], worker="w1", limit=2)
    lease_keeper = keeper([quiet, busy])
    leases = dict(Job.objects.values_list("pk", "leased_until"))
    with execute.running(busy):
        progress(1)
    lease_keeper.keep_up([quiet, busy], heartbeat=False)
    after = dict(Job.objects.values_list("pk", "leased_until"))
    assert after[quiet.pk] == leases[quiet.pk]  # not written: no new report
    assert after[busy.pk] > leases[busy.pk]  # written, and its lease extended with it
    assert stored(busy)["done"] == 1 and stored(busy)["total"] is None

    lease_keeper.keep_up([quiet, busy], heartbeat=True)
    assert Job.objects.get(pk=quiet.pk).leased_until > leases[quiet.pk]


@pytest.mark.django_db(transaction=True)
def test_a_row_locked_elsewhere_is_skipped_and_written_once_free(other_connection: Any) -> None:
    JobFactory.create_batch(2)
    locked, free = Job.objects.claim(["default"], worker="w1", limit=2)
    for job in (locked, free):
        with execute.running(job):
            progress(5, 10)
    lease_keeper = keeper([locked, free])
    with other_connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        with connection.cursor() as mine:
            mine.execute("SET lock_timeout = '2s'")  # waiting would fail the test, not hang it
        lease_keeper.keep_up([locked, free], heartbeat=False)
        assert stored(locked) is None
        assert stored(free)["done"] == 5
        cursor.execute("ROLLBACK")
    with connection.cursor() as mine:
        mine.execute("RESET lock_timeout")
    lease_keeper.keep_up([locked, free], heartbeat=False)  # tried again: it is still new
    assert stored(locked)["done"] == 5


@pytest.mark.django_db(transaction=True)
def test_a_lease_skipped_while_its_row_was_locked_is_renewed_the_next_round_not_heartbeat(
    other_connection: Any,
) -> None:
    """A handler (or an operator) holding the job's row lock near the lease's end: the keeper
    must renew it within a round of the lock's release, before the reaper can take it."""
    JobFactory()
    job = claim_one()
    lease_keeper = keeper([job])
    with other_connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [job.pk])
        lease_keeper.keep_up([job], heartbeat=True)
        cursor.execute("ROLLBACK")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET leased_until = now() + interval '1 second'")
    lease_keeper.keep_up([job], heartbeat=False)  # no new report: only the skipped lease
    left = Job.objects.filter(pk=job.pk).values_list("leased_until", flat=True).get()
    assert left > database_now() + timedelta(seconds=20)  # renewed for the 30 s lease
    lease_keeper.keep_up([job], heartbeat=False)
    assert Job.objects.filter(pk=job.pk).values_list("leased_until", flat=True).get() == left


@pytest.mark.parametrize("scribbled", ["null", "5", '"done"'])
def test_a_row_whose_progress_is_not_an_object_never_stops_the_heartbeats_or_the_outcome(
    scribbled: str,
) -> None:
    # Written by hand into a running job's row (JSON null, say, to "clear" it): the heartbeat
    # renews all of a worker's leases in one statement, so an error there would stop them all.
    JobFactory.create_batch(2)
    jobs = Job.objects.claim(["default"], worker="w1", limit=2)

    def report(done: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE pgjobs_job SET progress = %s::jsonb", [scribbled])
        for job in jobs:
            with execute.running(job):
                progress(done, 10)

    report(5)
    assert Job.objects.heartbeat(jobs) == {job.pk for job in jobs}
    assert [stored(job)["done"] for job in jobs] == [5, 5]
    report(7)
    assert Job.objects.retry_later(jobs[0], 60) is True
    assert stored(jobs[0])["done"] == 7
    report(10)
    assert Job.objects.complete(jobs[1]) is True
    assert stored(jobs[1])["done"] == 10


@pytest.mark.django_db(transaction=True)
def test_writing_progress_is_a_hot_update() -> None:
    JobFactory()
    job = claim_one()

    def updates() -> tuple[int, int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'pgjobs_job'"
            )
            row = cursor.fetchone()
        return int(row[0]), int(row[1])

    before = updates()
    for done in range(1, 6):
        with execute.running(job):
            progress(done, 5, note=f"step {done} " + "x" * 150)
        Job.objects.heartbeat([job])
    after = updates()
    assert stored(job)["done"] == 5
    assert (after[0] - before[0], after[1] - before[1]) == (5, 5)


def test_a_thread_started_in_the_handlers_context_reports_for_its_job_and_a_bare_one_cannot() -> (
    None
):
    JobFactory()
    job = claim_one()

    def work(done: int) -> None:
        progress(done, 10)

    with execute.running(job):
        context = contextvars.copy_context()
        inherited = threading.Thread(target=context.run, args=(work, 4))
        inherited.start()
        inherited.join()
        assert job.progress["done"] == 4
        bare = threading.Thread(target=work, args=(6,))  # no job in its context: nothing
        bare.start()
        bare.join()
    assert job.progress["done"] == 4


@pytest.mark.django_db(transaction=True)  # the keeper's thread has its own connection
def test_the_keeper_lives_on_after_a_round_that_raised_and_renews_the_leases(caplog: Any) -> None:
    """A keeper thread that ended on an unexpected error would let every lease of its worker run
    out under running handlers: the round is logged and the next one renews."""
    JobFactory()
    job = claim_one()
    leased_until = Job.objects.values_list("leased_until", flat=True).get(pk=job.pk)
    rounds = iter([RuntimeError("a bug"), [job], [job], [job], [job], [job]])

    def claims() -> list[Job]:
        found = next(rounds, [job])
        if isinstance(found, Exception):
            raise found
        return found

    lock_waits = LockWaits("default")
    lease_keeper = LeaseKeeper(Job.objects, claims, lambda job: 3.0, 3.0, lock_waits)
    lease_keeper.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            renewed = Job.objects.values_list("leased_until", flat=True).get(pk=job.pk)
            if renewed != leased_until:  # now + 3 s, from the heartbeat
                break
            time.sleep(0.1)
    finally:
        lease_keeper.stop()
        # Its session settings must not reach a later thread given the same ident.
        lock_waits.stop()
    assert "the lease keeper's round failed" in caplog.text
    assert renewed != leased_until


def test_a_lost_claim_is_logged_once_and_no_longer_written(caplog: Any) -> None:
    JobFactory()
    job = claim_one()
    expire_leases()
    Job.objects.reap()
    lease_keeper = keeper([job])
    for done in (1, 2, 3):
        with execute.running(job):
            progress(done, 3)
        lease_keeper.keep_up([job], heartbeat=done == 3)
    assert caplog.text.count("lost the lease of job") == 1
    assert stored(job) is None


# ---- the admin ------------------------------------------------------------------------------


def test_the_jobs_list_shows_a_running_jobs_bar_percentage_and_escaped_note() -> None:
    report = {"done": 2, "total": 3, "note": "<script>alert(1)</script>", "at": "x"}
    running = JobFactory(running=True, progress=report)
    JobFactory(succeeded=True, progress=report)  # finished: the list shows no bar
    response = staff("view_job").get(JOBS)
    page = response.content.decode()
    assert page.count('<progress class="pgjobs-progress-bar" value="66" max="100">') == 1
    assert "66%" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page
    assert running.short_id in page


def test_a_report_without_a_total_shows_a_moving_bar_and_the_count() -> None:
    JobFactory(running=True, progress={"done": 1204, "total": None, "note": ""})
    page = staff("view_job").get(JOBS).content.decode()
    assert '<progress class="pgjobs-progress-bar">1,204 done</progress>' in page


@pytest.mark.parametrize(
    "stored_value",
    [
        "text",
        [1, 2],
        {"done": "3"},
        {"done": True, "total": 2},
        {"done": 1, "total": -1},
        {"done": 10**400, "total": None},
        {"done": 1, "note": 5},
    ],
)
def test_a_stored_value_that_is_not_a_report_shows_as_none(stored_value: Any) -> None:
    job = JobFactory(running=True)
    Job.objects.filter(pk=job.pk).update(progress=stored_value)
    client = staff("view_job")
    assert "<progress" not in client.get(JOBS).content.decode()
    assert "<progress" not in client.get(detail(job)).content.decode()


@pytest.mark.parametrize(
    ("stored", "percent"),
    [
        # Whole numbers past a float's precision: one short of done is not 100%.
        ("jsonb_build_object('done', 99999999999999999, 'total', 100000000000000000)", 99),
        # Written by hand: jsonb keeps every digit, so Python reads an int of 309 digits and a
        # float, whose quotient 100 * done / total is past a float's range.
        ("jsonb_build_object('done', 1e308, 'total', 1.5e308 + 0.5)", 66),
    ],
)
def test_a_report_past_a_floats_precision_or_range_shows_its_percentage_rounded_down(
    stored: str, percent: int
) -> None:
    job = JobFactory(running=True)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE pgjobs_job SET progress = {stored} WHERE id = %s", [job.pk])
    client = staff("view_job")
    for page in (client.get(JOBS), client.get(detail(job))):
        assert page.status_code == 200
        assert f'value="{percent}" max="100"' in page.content.decode()


@pytest.mark.parametrize(
    ("at", "shown"),
    [
        ("2026-03-02T09:10:07", "March 2, 2026, 09:10:07 UTC"),  # no zone: UTC, as the history
        ("0001-01-01T00:00:00+14:00", None),  # before the first instant a datetime can hold
        ("9999-12-31T23:59:59-14:00", None),  # after the last
    ],
)
def test_a_report_written_at_a_time_that_cannot_be_shown_still_shows_on_the_job_page(
    at: str, shown: str | None
) -> None:
    job = JobFactory(running=True)
    Job.objects.filter(pk=job.pk).update(progress={"done": 1, "total": 4, "note": "", "at": at})
    page = staff("view_job").get(detail(job))
    assert page.status_code == 200
    content = page.content.decode()
    assert 'value="25" max="100"' in content
    assert ("reported" in content) == (shown is not None)
    assert shown is None or shown in content


def test_the_job_page_shows_the_last_report_with_when_it_was_written() -> None:
    JobFactory()
    job = claim_one()
    with execute.running(job):
        progress(1500, 2000, note="line one\nline two")
    Job.objects.complete(job)
    page = staff("view_job").get(detail(job)).content.decode()
    assert 'value="75" max="100"' in page
    assert "1,500 of 2,000 (75%)" in page
    assert "line one\nline two" in page
    assert "reported" in page and "<time datetime=" in page


def test_a_claim_its_worker_settled_during_the_keepers_round_is_not_reported_lost(
    caplog: Any,
) -> None:
    """The keeper read the claims, then the main thread recorded the job's outcome before the
    heartbeat ran, and forgot the claim only after: the job is not held, but was not lost."""
    JobFactory()
    job = claim_one()
    lease_keeper = keeper([job])
    assert Job.objects.complete(job)
    lease_keeper.keep_up([job], heartbeat=True)  # still among the claims this round
    lease_keeper.keep_up([], heartbeat=True)  # forgotten by the next
    assert "lost the lease" not in caplog.text
