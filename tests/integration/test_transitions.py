"""Every transition after the claim: finish, fail, retry, release, heartbeat, reap, replay..."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models.functions import Now

from django_pgjobs.data import sql
from django_pgjobs.data.records import Claim, FailedAttempt, Failure
from django_pgjobs.models import Job, QueueStat, Rollup, Worker
from django_pgjobs.outcomes import Verdict
from django_pgjobs.runtime import execute
from django_pgjobs.runtime.chores import Pruner, own_backoffs
from django_pgjobs.status import Status
from tests import plans, tasks
from tests.factories import JobFactory, backlog

pytestmark = pytest.mark.django_db


def claim_one(worker: str = "w1", **kwargs) -> Job:
    (job,) = Job.objects.claim(["default"], worker=worker, limit=1, **kwargs)
    return job


def expire_leases() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET leased_until = now() - interval '1 second' "
            "WHERE status = 'running'"
        )


def run_claimed(worker: str = "w1") -> Job:
    job = claim_one(worker)
    execute.settle(job, execute.run(job))
    return Job.objects.get(pk=job.pk)


def test_complete_finishes_the_job():
    JobFactory()
    job = claim_one()
    assert Job.objects.complete(job) is True
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.leased_until) == (Status.SUCCEEDED, None)
    assert row.finished_at is not None


def test_complete_keeps_a_result_only_when_given():
    JobFactory.create_batch(3)
    first, second, third = Job.objects.claim(["default"], worker="w1", limit=3)
    assert Job.objects.complete(first, '{"total": 12.5, "items": [1, 2]}') is True
    done, *_ = Job.objects.settle_and_claim(
        [second, third], [], [], worker="w1", limit=0, results={third.pk: '"ok"'}
    )
    assert done == {second.pk, third.pk}
    results = dict(Job.objects.values_list("pk", "result"))
    assert results == {first.pk: {"total": 12.5, "items": [1, 2]}, second.pk: None, third.pk: "ok"}


def test_the_claim_records_when_the_attempt_started():
    JobFactory()
    job = claim_one()
    assert job.started_at is not None and job.started_at >= job.run_at


def test_a_stale_worker_cannot_complete_or_fail_the_newer_attempt():
    JobFactory()
    stale = claim_one("slow-worker")
    expire_leases()
    assert reap() == (1, 0)
    Job.objects.filter(pk=stale.pk).update(run_at=stale.run_at)  # due again at once
    fresh = claim_one("fresh-worker")
    assert fresh.attempts == 2

    assert Job.objects.complete(stale) is False
    assert Job.objects.fail(stale, Failure("X", "late"), permanent=True, delay=0) is None
    assert Job.objects.retry_later(stale, 5) is False
    assert Job.objects.release([stale]) == set()
    assert Job.objects.heartbeat([stale]) == set()
    row = Job.objects.get(pk=fresh.pk)
    assert (row.status, row.worker, row.attempts) == (Status.RUNNING, "fresh-worker", 2)
    assert Job.objects.complete(fresh) is True


def test_the_same_worker_cannot_finish_an_earlier_attempt_of_a_job_it_claimed_again():
    JobFactory()
    first = claim_one("w1")
    expire_leases()
    reap()
    Job.objects.filter(pk=first.pk).update(run_at=first.run_at)
    second = claim_one("w1")
    assert Job.objects.complete(first) is False
    assert Job.objects.complete(second) is True


def test_complete_many_reports_which_jobs_were_still_owned():
    JobFactory.create_batch(3)
    jobs = Job.objects.claim(["default"], worker="w1", limit=3)
    Job.objects.filter(pk=jobs[0].pk).update(worker="someone-else")
    assert Job.objects.complete_many(jobs) == {jobs[1].pk, jobs[2].pk}


def test_a_worker_never_reaps_its_own_running_claims_but_reaps_a_stale_claim_of_the_same_job():
    """A handler that held its own row locked past the lease: its worker's reaper spares it (the
    lease keeper renews it once the lock is gone); another worker's reaper may still take it."""
    JobFactory.create_batch(2)
    mine, other = Job.objects.claim(["default"], worker="w1", limit=2)
    expire_leases()
    stale = Job.objects.get(pk=mine.pk)
    stale.claims -= 1  # an earlier claim of the same job: not the one running
    assert reap(sparing=[mine, stale]) == (1, 0)
    assert Job.objects.get(pk=mine.pk).status == Status.RUNNING
    assert Job.objects.get(pk=other.pk).status == Status.READY
    assert reap(sparing=[stale]) == (1, 0)  # another worker's view of it


def test_reap_returns_expired_jobs_to_ready_recording_a_lost_worker():
    job = JobFactory(expired=True, max_attempts=3)
    JobFactory(running=True)  # lease still valid: untouched
    assert reap() == (1, 0)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.leased_until, row.attempts) == (Status.READY, None, 1)
    assert row.last_error.startswith("WorkerLost: lease expired")
    assert row.errors[-1]["type"] == "WorkerLost"
    assert row.errors[-1]["worker"] == "lost-worker"
    assert Job.objects.filter(status=Status.RUNNING).count() == 1


def test_reap_fails_expired_jobs_that_have_no_attempts_left():
    job = JobFactory(expired=True, attempts=3, max_attempts=3)
    assert reap() == (0, 1)
    row = Job.objects.get(pk=job.pk)
    assert row.status == Status.FAILED and row.finished_at is not None
    assert "WorkerLost" in row.last_error


def reap(**options: Any) -> tuple[int, int]:
    """What a worker's reaper does: take back the expired leases, then give the jobs of tasks
    with a backoff of their own that backoff."""
    taken = Job.objects.reap(**options)
    Job.objects.delay(own_backoffs(taken))
    return taken.returned, taken.failed


def due_in() -> dict[object, tuple[float, bool]]:
    """Each job's seconds until due on the database's clock, and whether it is scheduled."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, extract(epoch FROM run_at - statement_timestamp())::float8, scheduled "
            "FROM pgjobs_job"
        )
        return {job_id: (seconds, scheduled) for job_id, seconds, scheduled in cursor.fetchall()}


def test_a_reaped_job_waits_out_its_tasks_own_backoff_as_a_failed_attempt_would():
    waits = JobFactory(expired=True, task="tests.tasks.fails_and_waits")  # backoff: 600 s
    at_once = JobFactory(expired=True, task="tests.tasks.overruns_then_retries_quietly")  # 0 s
    default = JobFactory(expired=True)  # no backoff of its own: PGJOBS' (at most 0.05 s here)
    assert reap() == (3, 0)
    due = due_in()
    assert 590 < due[waits.pk][0] <= 600 and due[waits.pk][1] is True
    assert due[at_once.pk][0] <= 0 and due[at_once.pk][1] is False  # in the claim index
    assert due[default.pk][0] <= 0.05 and due[default.pk][1] is True
    time.sleep(0.06)
    claimed = {job.pk for job in Job.objects.claim(["default"], worker="w2", limit=5)}
    assert claimed == {at_once.pk, default.pk}


def test_a_reaped_job_whose_tasks_backoff_fails_keeps_the_default_and_says_why(caplog):
    from tests import hostile  # noqa: F401  (registers its tasks)

    job = JobFactory(expired=True, task="tests.hostile.fails_with_infinite_backoff")
    assert reap() == (1, 0)
    seconds, scheduled = due_in()[job.pk]
    assert seconds <= 0.05 and scheduled is True
    assert "a reaped job of tests.hostile.fails_with_infinite_backoff keeps the default" in (
        caplog.text
    )
    assert "got inf" in caplog.text


def test_a_reaped_job_whose_tasks_backoff_hangs_keeps_the_default_without_stalling_the_reaper(
    caplog,
):
    from tests import hostile

    first, second = JobFactory.create_batch(
        2, expired=True, task="tests.hostile.times_out_and_its_backoff_hangs"
    )
    hostile.BACKOFF_RELEASED.clear()
    try:
        started = time.monotonic()
        assert reap(limit=1) == (1, 0)  # waits BACKOFF_PATIENCE (1 s), no more
        assert time.monotonic() - started < 5
        started = time.monotonic()
        assert reap(limit=1) == (1, 0)  # the first call still hangs: not asked again
        assert time.monotonic() - started < 0.5
    finally:
        hostile.BACKOFF_RELEASED.set()
    due = due_in()
    assert due[first.pk][0] <= 0.05 and due[second.pk][0] <= 0.05  # the default backoff
    assert "did not return within 1s" in caplog.text
    assert "has not returned from an earlier call" in caplog.text


def test_a_reap_asks_slow_backoffs_for_a_second_in_all_and_gives_the_rest_the_default():
    jobs = JobFactory.create_batch(10, expired=True, task="tests.hostile.has_a_slow_backoff")
    started = time.monotonic()
    assert reap() == (10, 0)
    assert time.monotonic() - started < 2.5  # not 10 x 0.3 s
    due = due_in()
    own = [job for job in jobs if due[job.pk][0] > 590]  # its backoff: 600 s
    assert 1 <= len(own) <= 4
    assert all(due[job.pk][0] <= 0.05 for job in jobs if job not in own)  # the default


def test_each_backoff_a_reap_asks_is_given_what_is_left_of_its_second(monkeypatch):
    from django_pgjobs import retry

    given: list[float | None] = []
    ask = retry.backoff_seconds

    def spy(backoff, attempts, task, *, within=None):
        given.append(within)
        return ask(backoff, attempts, task, within=within)

    monkeypatch.setattr(retry, "backoff_seconds", spy)
    JobFactory.create_batch(3, expired=True, task="tests.tasks.fails_and_waits")
    assert reap() == (3, 0)
    assert len(given) == 3
    assert retry.BACKOFF_PATIENCE >= given[0] > given[1] > given[2] > 0


def test_a_reaped_jobs_own_backoff_leaves_it_alone_once_claimed_again():
    """Between the reap and its task's backoff another worker may claim the job (the default
    backoff had it due): that claim is not moved."""
    job = JobFactory(expired=True, task="tests.tasks.fails_and_waits")
    reap()
    Job.objects.filter(pk=job.pk).update(run_at=job.run_at, scheduled=False)  # due at once
    claimed = claim_one("w2")
    rows_params = {"ids": [job.pk], "claims": [claimed.claims - 1], "delays": [600.0]}
    with connection.cursor() as cursor:
        cursor.execute(sql.REAP_BACKOFF, rows_params)
        assert cursor.rowcount == 0
    assert Job.objects.get(pk=job.pk).status == Status.RUNNING


def test_reap_is_bounded_and_safe_to_repeat():
    JobFactory.create_batch(5, expired=True)
    assert reap(limit=2) == (2, 0)
    assert reap(limit=10) == (3, 0)
    assert reap() == (0, 0)


@pytest.mark.django_db(transaction=True)
def test_taking_back_a_dead_workers_jobs_passes_over_a_row_locked_elsewhere(other_connection):
    # A supervisor takes back a dead child's jobs on its own loop: a row lock held elsewhere
    # (an application's select_for_update in an open transaction) stopped it restarting
    # children and honouring SIGTERM for as long as the lock was held.
    from tests.factories import JobFactory

    JobFactory.create_batch(3)
    locked, *others = Job.objects.claim(["default"], worker="dead", limit=3)
    with connection.cursor() as cursor:  # this session's wait, should there be one, fails
        cursor.execute("SET lock_timeout = '2s'")
    with other_connection.transaction():
        other_connection.execute("SELECT FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        assert Job.objects.abandon("dead", "its process died")[:2] == (2, 0)
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert statuses[locked.pk] == Status.RUNNING  # left to the reaper, at its lease's end
    assert {statuses[job.pk] for job in others} == {Status.READY}


def test_a_handler_reloading_its_job_after_its_claim_was_lost_changes_no_claim_its_worker_holds():
    """The worker keeps each claim (a Claim) beside the Job its handler gets (current_job()): a
    refresh_from_db() made after the lease was lost and another worker claimed the job must not
    make the worker's heartbeats and outcomes name the other worker's claim."""
    JobFactory.create_batch(2)
    lost, kept = Job.objects.claim(["default"], worker="w1", limit=2)
    claims = [Claim.of(lost), Claim.of(kept)]  # what the worker keeps (runtime/sources.Claims)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET leased_until = now() - interval '1 second' WHERE id = %s",
            [lost.pk],
        )
    assert reap() == (1, 0)
    time.sleep(0.06)  # the default backoff, here at most 0.05 s
    (theirs,) = Job.objects.claim(["default"], worker="w2", limit=1)
    assert theirs.pk == lost.pk
    lost.refresh_from_db()  # what a handler may do
    assert (lost.worker, lost.claims) == ("w2", 2)
    assert Job.objects.heartbeat(claims) == {kept.pk}
    settled = Job.objects.settle_and_claim(claims, [], [], worker="w1", limit=0)
    assert settled.succeeded == {kept.pk}
    row = Job.objects.get(pk=lost.pk)
    assert (row.status, row.worker, row.claims) == (Status.RUNNING, "w2", 2)


def test_heartbeat_extends_the_lease_from_the_database_clock():
    JobFactory()
    job = claim_one(lease=5)
    assert Job.objects.heartbeat([job], lease=300) == {job.pk}
    with connection.cursor() as cursor:
        cursor.execute("SELECT leased_until - statement_timestamp() FROM pgjobs_job")
        (remaining,) = cursor.fetchone()
    assert remaining > timedelta(seconds=290)


def test_release_returns_the_job_without_spending_an_attempt():
    JobFactory()
    job = claim_one()
    assert Job.objects.release([job]) == {job.pk}
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempts, row.leased_until) == (Status.READY, 0, None)


def test_a_failing_job_retries_with_growing_backoff_then_dead_letters_keeping_the_error():
    JobFactory(task="tests.tasks.always_fails", max_attempts=3)
    for attempt in (1, 2):
        row = run_claimed()
        assert (row.status, row.attempts) == (Status.READY, attempt)
        assert row.last_error == "RuntimeError: boom"
        Job.objects.filter(pk=row.pk).run_now()
    row = run_claimed()
    assert (row.status, row.attempts) == (Status.FAILED, 3)
    assert row.finished_at is not None
    assert [e["attempt"] for e in row.errors] == [1, 2, 3]
    assert row.errors[-1]["type"] == "RuntimeError"
    assert "raise RuntimeError" in row.errors[-1]["traceback"]
    assert row.errors[-1]["worker"] == "w1"


def test_a_retry_waits_its_backoff_on_the_database_clock():
    JobFactory(task="tests.tasks.always_fails", max_attempts=3)
    job = claim_one()
    Job.objects.fail(job, Failure("RuntimeError", "boom"), permanent=False, delay=600)
    with connection.cursor() as cursor:
        cursor.execute("SELECT run_at - statement_timestamp() FROM pgjobs_job")
        (wait,) = cursor.fetchone()
    assert timedelta(seconds=590) < wait <= timedelta(seconds=600)
    assert Job.objects.claim(["default"], worker="w1", limit=1) == []


@pytest.mark.parametrize(
    "task",
    [
        "tests.tasks.fails_permanently",
        "tests.tasks.missing_object",
        "tests.tasks.raises_task_permanent",
    ],
)
def test_permanent_errors_fail_at_once(task):
    JobFactory(task=task, max_attempts=5)
    row = run_claimed()
    assert (row.status, row.attempts) == (Status.FAILED, 1)


def test_a_payload_that_does_not_fit_the_handler_is_a_permanent_error():
    JobFactory(task="tests.tasks.send_email", payload={"recipient": "x"}, max_attempts=5)
    row = run_claimed()
    assert row.status == Status.FAILED
    assert "the payload does not fit tests.tasks.send_email(to, subject='')" in row.last_error


def test_a_payload_that_is_not_an_object_is_a_permanent_error():
    JobFactory(payload=[1, 2], max_attempts=5)
    row = run_claimed()
    assert row.status == Status.FAILED
    assert "payload must be a JSON object" in row.last_error


def test_a_row_naming_an_unregistered_task_is_dead_lettered_and_nothing_is_imported():
    import sys

    sys.modules.pop("antigravity", None)
    JobFactory(task="antigravity.fly", max_attempts=5)
    row = run_claimed()
    assert row.status == Status.FAILED
    assert "No task is registered as 'antigravity.fly'" in row.last_error
    assert "antigravity" not in sys.modules


def test_a_row_naming_an_unregistered_task_saves_what_to_do_in_place_of_a_traceback():
    JobFactory(task="tests.tasks.send_emial")
    [error] = run_claimed().errors
    assert error["type"] == "django_pgjobs.errors.UnknownTask"
    assert error["traceback"] == (
        "This worker cannot run 'tests.tasks.send_emial': a worker runs only the tasks its own "
        "code registers with @task, and never imports one by the name in a job.\n"
        "Registered tasks with a close name: tests.tasks.send_email. A function that was "
        "renamed or moved keeps its jobs' name with @task(name=...).\n"
        "To run the job: deploy the code that defines it to every worker, then replay the job "
        "(the admin's Dead letters, or Job.objects.filter(pk=...).replay()).\n"
        "If nothing should run it any more: delete the job.\n"
    )


@pytest.mark.parametrize("task", ["tests.tasks.exits", "tests.tasks.interrupts"])
def test_system_exit_and_keyboard_interrupt_from_a_handler_are_ordinary_errors(task):
    JobFactory(task=task, max_attempts=3)
    outcome = execute.run(claim_one())
    assert outcome.verdict is Verdict.ERROR and not outcome.permanent


def test_retry_from_a_handler_reschedules_without_spending_an_attempt():
    JobFactory(task="tests.tasks.asks_to_retry", payload={"seconds": 120}, max_attempts=1)
    row = run_claimed()
    assert (row.status, row.attempts, row.last_error) == (Status.READY, 0, "")
    assert Job.objects.claim(["default"], worker="w1") == []


def test_async_handlers_run():
    JobFactory(task="tests.tasks.async_noop", payload={"value": 41})
    row = run_claimed()
    assert row.status == Status.SUCCEEDED
    assert tasks.calls["async_noop:41"] == 1


def test_error_text_that_postgres_would_refuse_is_cleaned_before_it_is_written():
    JobFactory()
    job = claim_one()
    failure = Failure("Bad\x00Type", "nul \x00 and surrogate \udcff " + "x" * 10_000, "tb\x00")
    assert Job.objects.fail(job, failure, permanent=True, delay=0) == Status.FAILED
    row = Job.objects.get(pk=job.pk)
    assert "\x00" not in row.last_error and len(row.last_error) <= 2000
    assert row.errors[-1]["type"] == "Bad\\x00Type"


def test_the_error_history_is_bounded(settings):
    settings.PGJOBS = {**settings.PGJOBS, "ERRORS_KEPT": 2}
    JobFactory(task="tests.tasks.always_fails", max_attempts=4)
    for _ in range(4):
        row = run_claimed()
        Job.objects.filter(pk=row.pk).run_now()
    assert [e["attempt"] for e in Job.objects.get().errors] == [3, 4]


def test_replay_gives_a_dead_letter_a_fresh_attempt_budget_due_now():
    dead = JobFactory(dead=True, future=True)
    assert Job.objects.filter(pk=dead.pk).replay() == [dead.pk]
    row = Job.objects.get(pk=dead.pk)
    assert (row.status, row.attempts, row.finished_at) == (Status.READY, 0, None)
    assert row.errors[:-1] == dead.errors  # the history stays for inspection,
    assert "replayed_at" in row.errors[-1]  # and records the replay
    assert claim_one().pk == dead.pk


def test_replay_into_another_queue_and_only_for_failed_or_cancelled_jobs():
    dead = JobFactory(dead=True)
    cancelled = JobFactory(cancelled=True)
    running = JobFactory(running=True)
    ready = JobFactory()
    assert sorted(Job.objects.all().replay(queue="retries")) == sorted([dead.pk, cancelled.pk])
    assert Job.objects.get(pk=dead.pk).queue == "retries"
    assert Job.objects.get(pk=cancelled.pk).status == Status.READY
    assert Job.objects.get(pk=running.pk).status == Status.RUNNING
    assert Job.objects.get(pk=ready.pk).queue == "default"


def test_replay_skips_a_dead_letter_whose_unique_key_a_live_job_holds():
    dead = JobFactory(dead=True, unique_key="k")
    JobFactory(unique_key="k")
    assert Job.objects.filter(pk=dead.pk).replay() == []


@pytest.mark.django_db
def test_replaying_dead_letters_that_share_a_key_replays_the_oldest_and_skips_the_rest():
    first = Job.objects.enqueue("tests.tasks.noop", unique_key="order-7")
    Job.objects.filter(pk=first.pk).cancel()
    second = Job.objects.enqueue("tests.tasks.noop", unique_key="order-7")
    Job.objects.filter(pk=second.pk).cancel()
    other = Job.objects.enqueue("tests.tasks.noop")
    Job.objects.filter(pk=other.pk).cancel()

    replayed = Job.objects.all().replay()

    assert sorted(replayed) == sorted([first.pk, other.pk])
    assert Job.objects.get(pk=second.pk).status == Status.CANCELLED
    # Again: the key is held by the replayed job now, so nothing more is replayed.
    assert Job.objects.all().replay() == []


def test_run_now_makes_a_scheduled_job_due():
    ready = JobFactory(future=True)
    assert Job.objects.filter(pk=ready.pk).run_now() == [ready.pk]
    assert claim_one().pk == ready.pk


def test_a_transition_leaves_a_job_whose_status_changed_after_it_was_selected(other_connection):
    dead = JobFactory(dead=True)
    selection = Job.objects.filter(pk=dead.pk)
    with other_connection.transaction():
        # Another admin replays the job first; ours waits for its row lock, then re-checks.
        other_connection.execute(
            "UPDATE pgjobs_job SET status = 'running', leased_until = now() + interval '1 min', "
            "finished_at = NULL WHERE id = %s",
            [dead.pk],
        )
        result: list[object] = []

        def replay() -> None:
            try:
                result.append(selection.replay())
            finally:
                connections.close_all()

        thread = threading.Thread(target=replay)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the other transaction's row lock
    thread.join(10)
    assert result == [[]]
    assert Job.objects.get(pk=dead.pk).status == Status.RUNNING


def test_discard_deletes_the_selection_except_running_jobs():
    running, dead, ready = JobFactory(running=True), JobFactory(dead=True), JobFactory()
    assert sorted(Job.objects.all().discard()) == sorted([dead.pk, ready.pk])
    assert list(Job.objects.values_list("pk", flat=True)) == [running.pk]


def test_prune_deletes_old_finished_jobs_in_bounded_batches(settings):
    settings.PGJOBS = {**settings.PGJOBS, "PRUNE_BATCH": 10}
    JobFactory.create_batch(25, succeeded=True, enqueued_ago=3 * 3600)
    keep = [
        JobFactory(dead=True, enqueued_ago=3 * 3600),
        JobFactory(enqueued_ago=3 * 3600),
        JobFactory(running=True, enqueued_ago=3 * 3600),
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET finished_at = now() - interval '2 hours' "
            "WHERE finished_at IS NOT NULL"
        )
    JobFactory(succeeded=True)  # too recent
    assert Job.objects.prune(max_batches=1) == 10
    assert Job.objects.prune() == 15
    assert Job.objects.prune() == 0
    assert Job.objects.filter(pk__in=[job.pk for job in keep]).count() == 3
    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 1


def test_a_prune_batch_is_bounded_whatever_plan_the_database_chooses(settings):
    # Before: deleted through `id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`, which a
    # nested-loop plan (chosen on stale statistics; CI met it) ran again for each row: the
    # first batch deleted all 25.
    settings.PGJOBS = {**settings.PGJOBS, "PRUNE_BATCH": 10}
    JobFactory.create_batch(25, succeeded=True, enqueued_ago=3 * 3600)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET finished_at = now() - interval '2 hours' "
            "WHERE finished_at IS NOT NULL"
        )
        for method in ("hashjoin", "mergejoin", "material", "hashagg", "sort"):
            cursor.execute(f"SET LOCAL enable_{method} = off")  # until the test's rollback
    assert Job.objects.prune(max_batches=1) == 10
    assert Job.objects.count() == 15


def test_a_handler_can_see_which_job_and_attempt_it_is_running():
    from django_pgjobs import current_job

    job = JobFactory(task="tests.tasks.reports_its_job")
    run_claimed("w9")
    assert tasks.seen_jobs[-1] == (job.pk, 1, "w9")
    assert current_job() is None


def test_prune_skips_rows_another_pruner_has_locked(other_connection):
    old = JobFactory.create_batch(3, succeeded=True, enqueued_ago=3 * 3600)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET finished_at = now() - interval '2 hours'")
    with other_connection.transaction():
        other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [old[0].pk])
        assert Job.objects.prune() == 2


def test_finding_prunable_jobs_reads_a_range_of_ids_not_every_finished_job():
    backlog(finished=20_000)
    sql, params = Job.objects.prunable().values("pk").query.sql_with_params()
    plan = plans.explain(sql, params, analyze=True)
    # None is old enough: the ids (UUIDv7, enqueue time first) bound the search to nothing
    # (then what a batch or a waiting job keeps is looked up for no row).
    scan = next(node for node in plans.nodes(plan) if node.get("Relation Name") == "pgjobs_job")
    assert scan["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan"), plan
    assert scan["Actual Rows"] == 0
    assert scan.get("Rows Removed by Filter", 0) == 0


def test_a_worker_prunes_again_within_a_quarter_of_the_shortest_retention(settings):
    pruner = Pruner(Job.objects, 60.0)
    settings.PGJOBS = {**settings.PGJOBS, "RETENTION": timedelta(hours=1)}
    assert pruner.run() == 60.0  # the interval, sooner than a quarter of an hour
    settings.PGJOBS = {**settings.PGJOBS, "RETENTION": {"succeeded": timedelta(seconds=8)}}
    assert pruner.run() == 2.0  # a job is deleted at most 2 s after its retention
    settings.PGJOBS = {**settings.PGJOBS, "RETENTION": timedelta(0)}
    assert pruner.run() == 1.0  # never more than once a second while there is no backlog
    settings.PGJOBS = {**settings.PGJOBS, "PRUNE_BATCH": 2}
    JobFactory.create_batch(3, succeeded=True, enqueued_ago=3 * 3600)
    assert pruner.run() == 0.0  # a full batch: again at the next turn


def test_a_worker_prunes_its_own_statistics_rows_sooner_than_their_rollup():
    # Rolled up as they arrive, the workers' rows are kept a quarter of an hour; the rollup and
    # the workers' last reports for STATS_RETENTION (a day).
    for minutes in (10, 20, 60 * 30):
        QueueStat.objects.create(
            at=Now() - timedelta(minutes=minutes), seconds=10, worker=f"w{minutes}", queue="q"
        )
    Pruner(Job.objects, 60.0).run()
    assert list(QueueStat.objects.values_list("worker", flat=True)) == ["w10"]
    assert sorted(Worker.objects.values_list("name", flat=True)) == ["w10", "w20"]
    assert Rollup.objects.filter(step=60).count() == 2


#: Text that a turn's arrays carry exactly, whatever their encoding must quote or escape.
AWKWARD = [
    'a "quoted", {braced} \\ back\\slash',
    "NULL",
    "",
    " spaced ",
    "tab\there\nline",
    "ünï ☃",
]


def test_a_turn_records_awkward_results_and_errors_exactly():
    JobFactory.create_batch(2 * len(AWKWARD))
    claimed = Job.objects.claim(["default"], worker="w1", limit=2 * len(AWKWARD))
    succeeded, failing = claimed[: len(AWKWARD)], claimed[len(AWKWARD) :]
    results = {
        job.pk: json.dumps({"text": text}) for job, text in zip(succeeded, AWKWARD, strict=True)
    }
    failed = [
        FailedAttempt(job, Failure("ValueError", text, f"Traceback:\n  {text}\n"), True, 0.0)
        for job, text in zip(failing, AWKWARD, strict=True)
    ]
    done, statuses, *_ = Job.objects.settle_and_claim(
        succeeded, failed, [], worker="w1", limit=0, results=results
    )
    assert done == {job.pk for job in succeeded}
    assert set(statuses.values()) == {Status.FAILED}
    for job, text in zip(succeeded, AWKWARD, strict=True):
        assert Job.objects.get(pk=job.pk).result == {"text": text}
    for job, text in zip(failing, AWKWARD, strict=True):
        row = Job.objects.get(pk=job.pk)
        assert row.last_error == (f"ValueError: {text}" if text else "ValueError")
        assert (row.errors[-1]["message"], row.errors[-1]["traceback"]) == (
            text,
            f"Traceback:\n  {text}\n",
        )


@pytest.mark.django_db(transaction=True)
def test_a_cancel_over_rows_a_worker_holds_for_its_turn_does_not_deadlock_with_it(
    other_connection,
):
    # A worker's turn holds the ready rows it is claiming while it waits to record its running
    # ones' outcomes; a cancel over both that waited on a row would wait for the worker, which
    # waits for the row the cancel wrote: PostgreSQL ended one of them (an operator's 500, a
    # worker's turn rolled back).
    Job.objects.enqueue(tasks.noop)
    running = claim_one("w1")
    ready = Job.objects.enqueue(tasks.noop)
    other_connection.execute("BEGIN")  # the worker's turn: claiming `ready`...
    other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [ready.pk])
    cancelled: list[object] = []

    def cancel() -> None:
        try:
            cancelled.append(Job.objects.filter(pk__in=[running.pk, ready.pk]).cancel())
        finally:
            connections.close_all()

    thread = threading.Thread(target=cancel)
    thread.start()
    time.sleep(0.2)  # the cancel has reached the rows
    # ...then recording `running`'s outcome, in the same statement.
    other_connection.execute("UPDATE pgjobs_job SET progress = NULL WHERE id = %s", [running.pk])
    other_connection.execute("COMMIT")
    thread.join(10)
    assert cancelled and sorted(cancelled[0]) == sorted([running.pk, ready.pk])  # type: ignore[arg-type]
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert statuses == {running.pk: Status.RUNNING, ready.pk: Status.CANCELLED}
    assert Job.objects.get(pk=running.pk).cancel_requested


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("transition", ["cancel", "discard"])
def test_a_sliced_selection_changes_only_its_own_jobs_when_one_was_locked_for_a_moment(
    other_connection, transition
):
    # The rows passed over while locked were looked for again by running the selection again:
    # a slice ([:3]) then took the next rows (attack 12: [:10].discard() deleted 19 jobs).
    ids = sorted(Job.objects.enqueue(tasks.noop).pk for _ in range(6))
    selected = set(ids[:3])
    other_connection.execute("BEGIN")  # a worker's claim holds one of them for a moment
    other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [ids[1]])
    release = threading.Timer(0.2, lambda: other_connection.execute("COMMIT"))
    release.start()
    try:
        changed = getattr(Job.objects.order_by("id")[:3], transition)()
    finally:
        release.join()
    assert set(changed) == selected
    untouched = Job.objects.filter(status=Status.READY).values_list("pk", flat=True)
    assert set(untouched) == set(ids[3:])
