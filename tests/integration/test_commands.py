from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_jobstats_reports_depth_age_retries_running_and_dead_letters_per_queue(
    other_connection,
):
    JobFactory.create_batch(3)
    JobFactory(future=True, attempts=1)
    JobFactory(running=True)
    JobFactory(dead=True, queue="emails")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET run_at = now() - interval '90 seconds' "
            "WHERE status = 'ready' AND run_at <= now()"
        )
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT count(*) FROM pgjobs_job")  # holds a snapshot
    report = json.loads(run("jobstats", "--json"))
    other_connection.execute("ROLLBACK")
    queues = {q["queue"]: q for q in report["queues"]}
    assert queues["default"]["due"] == 3
    assert queues["default"]["scheduled"] == 1
    assert queues["default"]["retrying"] == 1
    assert queues["default"]["running"] == 1
    assert queues["emails"]["failed"] == 1
    assert 89 < queues["default"]["oldest_due_seconds"] < 200
    assert report["table"]["live_tuples"] >= 0
    assert report["table"]["oldest_snapshot_query"] == "SELECT count(*) FROM pgjobs_job"
    assert "default" in run("jobstats")


def test_prunejobs_deletes_old_finished_jobs_and_keeps_dead_letters():
    JobFactory.create_batch(4, succeeded=True)
    JobFactory(dead=True)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET finished_at = now() - interval '1 day'")
    assert run("prunejobs", "--older-than", "3600").strip() == "pruned 4 finished jobs"
    assert list(Job.objects.values_list("status", flat=True)) == [Status.FAILED]


def test_runjobs_once_drains_what_is_due_and_restores_the_signal_handlers():
    import signal

    JobFactory.create_batch(5)
    JobFactory(future=True)
    before = signal.getsignal(signal.SIGTERM)
    call_command("runjobs", "--once", verbosity=0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 5
    assert Job.objects.filter(status=Status.READY).count() == 1


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--queue", "bad queue"], "not a valid queue name"),
        (["--concurrency", "0"], "must be greater than 0"),
        (["--lease", "soon"], "is not a number"),
    ],
)
def test_runjobs_refuses_bad_options_with_a_clear_message(option, message, capsys):
    from django.core.management import CommandError

    with pytest.raises(CommandError, match=message):
        call_command("runjobs", *option)
