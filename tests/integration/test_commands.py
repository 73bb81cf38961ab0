from __future__ import annotations

import contextlib
import json
import logging
import uuid
from datetime import timedelta
from io import StringIO

import django
import pytest
from django.core.management import call_command
from django.db import connection

from django_pgjobs.models import Job, QueueStat
from django_pgjobs.observability import stats
from django_pgjobs.runtime import sessions
from django_pgjobs.status import Status
from tests.conftest import statistics_count
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_jobstats_reports_depth_age_retries_running_and_dead_letters_per_queue(
    other_connection,
):
    # The verdict reads table-wide statistics: start them afresh, whatever earlier tests left
    # (test_claim_cost's 200,000 rolled-back inserts count as dead tuples, "tune autovacuum").
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_reset_single_table_counters('pgjobs_job'::regclass)")
    JobFactory.create_batch(3)
    JobFactory(retrying=True)  # scheduled (its backoff) and retrying
    JobFactory(running=True)
    JobFactory(dead=True, queue="emails")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET run_at = now() - interval '90 seconds' "
            "WHERE status = 'ready' AND run_at <= now()"
        )
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT count(*) FROM pgjobs_job")  # holds a snapshot
    QueueStat.objects.create(seconds=10, worker="w", queue="default")  # a live worker serves it
    statistics_count(live=6)
    report = json.loads(run("jobstats", "--json"))
    other_connection.execute("ROLLBACK")
    assert report["status"] == "healthy"
    queues = {q["queue"]: q for q in report["queues"]}
    assert queues["default"]["due"] == 3
    assert queues["default"]["scheduled"] == 1
    assert queues["default"]["retrying"] == 1
    assert queues["default"]["running"] == 1
    assert queues["emails"]["failed"] == 1
    assert 89 < queues["default"]["oldest_due_seconds"] < 200
    assert report["table"]["live_tuples"] >= 6  # the jobs this test wrote
    assert report["database"]["oldest_snapshot_query"] == "SELECT count(*) FROM pgjobs_job"


def as_a_user_who_reads(*tables: str) -> None:
    """Go on as a new database user who may read only `tables`, without pg_monitor (the role
    and the switch are undone with the test's transaction)."""
    role = f"pgjobs_probe_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role}")
        cursor.execute(f"GRANT SELECT ON {', '.join(tables)} TO {role}")
        cursor.execute(f"SET LOCAL ROLE {role}")


def test_jobstats_that_may_not_read_the_figures_exits_unknown_in_one_line():
    as_a_user_who_reads("pgjobs_job", "pgjobs_queue")
    out = StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("jobstats", stdout=out)
    assert exited.value.code == 3
    assert out.getvalue() == (
        "verdict: UNKNOWN: the report could not be read (permission denied for table "
        "pgjobs_rollup): the database user needs SELECT on the pgjobs tables, and the "
        "pg_monitor role to read PostgreSQL's statistics\n"
    )


def test_jobstats_says_when_other_users_sessions_are_hidden_from_it():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_has_role('pg_read_all_stats', 'USAGE')")
        (sees_all,) = cursor.fetchone()
    assert ("hidden from this database user" in report()) is not sees_all
    as_a_user_who_reads(
        "pgjobs_job", "pgjobs_queue", "pgjobs_queuestat", "pgjobs_rollup", "pgjobs_worker"
    )
    assert "(other users' sessions are hidden from this database user: " in report()
    assert json.loads(report("--json"))["database"]["sees_all_sessions"] is False


def report(*args: str) -> str:
    """What jobstats prints, whatever its verdict (the server's other sessions count too)."""
    out = StringIO()
    with contextlib.suppress(SystemExit):
        call_command("jobstats", *args, stdout=out)
    return out.getvalue()


def test_prunejobs_deletes_old_finished_jobs_and_keeps_dead_letters():
    JobFactory.create_batch(4, succeeded=True, enqueued_ago=2 * 86400)
    JobFactory(dead=True, enqueued_ago=2 * 86400)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET finished_at = now() - interval '1 day'")
    assert run("prunejobs", "--older-than", "3600").strip() == "pruned 4 finished jobs"
    assert list(Job.objects.values_list("status", flat=True)) == [Status.FAILED]


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
def test_runjobs_once_drains_what_is_due_and_restores_the_signal_handlers():
    import signal

    JobFactory.create_batch(5)
    JobFactory(future=True)
    before = signal.getsignal(signal.SIGTERM)
    call_command("runjobs", "--once", verbosity=0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 5
    assert Job.objects.filter(status=Status.READY).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_stopped_is_reported_stopped_not_alive(signal_handlers_restored):
    JobFactory.create_batch(3)
    call_command("runjobs", "--once", verbosity=0)
    (worker,) = stats.worker_stats()
    assert (worker.alive, worker.stopped, worker.queues) == (False, True, ["default"])
    text = report()
    assert "workers: 0 alive; stopped in the last 15 minutes: " in text
    assert f"{worker.worker} " in text


@pytest.mark.django_db(transaction=True)
def test_runjobs_warns_of_a_lease_under_ten_seconds(caplog, signal_handlers_restored):
    call_command("runjobs", "--once", "--lease", "2", verbosity=0)
    assert "--lease 2 is under 10s: heartbeats go out every lease/3 and the reaper looks " in (
        caplog.text
    )


@pytest.mark.django_db(transaction=True)
def test_runjobs_warns_at_start_of_a_queue_nothing_uses_and_of_queues_nobody_serves(
    caplog, signal_handlers_restored
):
    QueueStat.objects.create(seconds=10, worker="elsewhere", queue="payments")  # alive, serving
    call_command("runjobs", "--once", "--queue", "emial", "--queue", "default", verbosity=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (worker,) = [w.worker for w in stats.worker_stats() if w.worker != "elsewhere"]
    typo = [line for line in warnings if "'emial'" in line]
    assert len(typo) == 1
    assert (
        f"the queue 'emial', served by worker {worker}, is used by no registered task, periodic "
        "schedule or Django Tasks backend"
    ) in typo[0]
    assert "a typo in --queue? Jobs reach it only when enqueued with queue='emial'." in typo[0]
    assert (
        "no running worker serves the queue 'emails', which tests.tasks.send_email, "
        "example_project.shop.tasks.send_confirmation use: its jobs wait until a worker does "
        f"(runjobs --queue emails; served by worker {worker}: emial, default)."
    ) in warnings
    assert "no running worker serves the queue 'warehouse', " in "\n".join(warnings)
    served_elsewhere_or_here = tuple(
        f"no running worker serves the queue {q!r}" for q in ("payments", "default")
    )
    assert not [line for line in warnings if line.startswith(served_elsewhere_or_here)]


@pytest.mark.django_db(transaction=True)
def test_runjobs_with_no_task_registered_asks_whether_the_tasks_app_is_installed(
    caplog, monkeypatch, signal_handlers_restored
):
    """The app holding tasks.py left out of INSTALLED_APPS: the warning says so, rather than
    "(they use )"; and one task's queue that nobody serves is what that task "uses"."""
    monkeypatch.setattr(sessions, "used_queues", lambda: {})
    call_command("runjobs", "--once", "--queue", "emails", verbosity=0)
    assert (
        "Django Tasks backend (no task is registered at all: is the app with your tasks module "
        "in INSTALLED_APPS?): a typo in --queue?"
    ) in caplog.text
    caplog.clear()
    monkeypatch.setattr(sessions, "used_queues", lambda: {"emails": ["myapp.tasks.send_welcome"]})
    call_command("runjobs", "--once", "--queue", "emial", verbosity=0)
    assert "(they use emails): a typo in --queue?" in caplog.text
    assert (
        "no running worker serves the queue 'emails', which myapp.tasks.send_welcome uses: "
    ) in caplog.text


@pytest.mark.skipif(
    django.VERSION >= (6, 1),
    reason="Django 6.1 passes every alias to every check, with or without --database, so a "
    "check cannot tell that the database checks were skipped (pgjobs.I001 is not given there)",
)
def test_check_deploy_without_a_database_points_at_the_database_checks():
    # --fail-level: the test settings fail other apps' deploy checks (Django 6.1's mail.E001).
    out = StringIO()
    call_command("check", "--deploy", "--fail-level", "CRITICAL", stderr=out, stdout=out)
    assert "(pgjobs.I001) django-pgjobs's database checks did not run: " in out.getvalue()
    assert "HINT: Run `manage.py check --deploy --database default` to run them." in (
        out.getvalue()
    )
    out = StringIO()
    call_command(
        "check", "--deploy", "--database", "default", "--fail-level", "CRITICAL",
        stderr=out, stdout=out,
    )  # fmt: skip
    assert "pgjobs.I001" not in out.getvalue()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--queue", "bad queue"], "not a valid queue name"),
        (["--concurrency", "0"], "must be greater than 0"),
        (["--lease", "soon"], "is not a number"),
        (
            ["--lease", "0.5"],
            "argument --lease: must be at least 1 second, got 0.5: heartbeats renew a lease "
            "every lease/3 seconds, so a shorter lease is lost while its job still runs",
        ),
        (["--lease", "inf"], r"must be below 1e\+09 seconds, got inf"),
        (["--lease", "nan"], "must be at least 1 second, got nan"),
        (
            ["--grace", "-1"],
            "argument --grace: must be 0 or more seconds, got -1: the time running jobs get "
            "to finish after a stop signal",
        ),
        (["--grace", "nan"], "must be 0 or more seconds, got nan"),
        (["--max-jobs-per-child", "3"], "--once drains the queues and exits; --max-jobs-per"),
    ],
)
def test_runjobs_refuses_bad_options_with_a_clear_message(option, message, capsys):
    from django.core.management import CommandError

    with pytest.raises(CommandError, match=message):
        call_command("runjobs", *option, "--once")  # without the check, it must not hang


def finished_ago(job: Job, seconds: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET finished_at = now() - make_interval(secs => %s) WHERE id = %s",
            [seconds, job.pk],
        )


def test_prune_keeps_each_final_status_for_its_own_retention(settings):
    settings.PGJOBS = {
        "RETENTION": {"succeeded": timedelta(minutes=10), "failed": timedelta(days=7)}
    }
    old_success, new_success = JobFactory.create_batch(2, succeeded=True)
    old_cancel = JobFactory(cancelled=True)
    old_dead, new_dead = JobFactory.create_batch(2, dead=True)
    finished_ago(old_success, 11 * 60)
    finished_ago(new_success, 9 * 60)
    finished_ago(old_cancel, 30 * 60)  # cancelled keeps its default hour
    finished_ago(old_dead, 8 * 86400)
    finished_ago(new_dead, 6 * 86400)
    assert Job.objects.prune() == 2
    assert set(Job.objects.values_list("pk", flat=True)) == {
        new_success.pk,
        old_cancel.pk,
        new_dead.pk,
    }


def test_prunejobs_dry_run_counts_by_status_and_deletes_nothing():
    old = {"enqueued_ago": 2 * 86400}
    for job in [*JobFactory.create_batch(3, succeeded=True, **old), JobFactory(dead=True, **old)]:
        finished_ago(job, 86400)
    out = run("prunejobs", "--dry-run")
    assert "succeeded: 3 would be pruned (retention 3600s)" in out
    assert "failed: 0 would be pruned (retention kept)" in out
    assert Job.objects.count() == 4
    out = run("prunejobs", "--dry-run", "--failed-older-than", "3600")
    assert "failed: 1 would be pruned (retention 3600s)" in out
    assert run("prunejobs", "--failed-older-than", "3600").strip() == "pruned 4 finished jobs"
    assert Job.objects.count() == 0


def test_prunejobs_refuses_a_negative_retention():
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="must be 0 or more seconds, got -5"):
        run("prunejobs", "--older-than", "-5")
