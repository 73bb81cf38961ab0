"""The commands against a database that is down or never migrated, as real processes: one line
saying what is wrong and what to do, and the exit status each documents, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import connection_kwargs
from tests.crash.conftest import ROOT, manage, scratch_database


@pytest.fixture
def unmigrated(transactional_db: None) -> Iterator[str]:
    """A new, empty database: what a project has before its first `migrate` (runjobs on one:
    tests/crash/test_outage.py)."""
    with scratch_database("unmigrated") as name:
        yield name


@pytest.mark.parametrize(
    "code",
    [
        "from tests import tasks; tasks.noop.enqueue()",
        "from tests import tasks; from django_pgjobs.models import Job; "
        "Job.objects.bulk_enqueue(tasks.noop, [{}, {}])",
    ],
    ids=["enqueue", "bulk_enqueue"],
)
def test_enqueue_before_migrate_says_to_run_migrate(unmigrated, code):
    done = manage("shell", "-c", code, PGJOBS_TEST_DATABASE=unmigrated)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "django_pgjobs.errors.NotMigrated: the pgjobs tables are missing or out of date "
        '(relation "pgjobs_job" does not exist): run `manage.py migrate`'
    ), done.stderr


@pytest.mark.parametrize("processes", [[], ["--processes", "2"]], ids=["worker", "supervisor"])
def test_runjobs_before_migrate_stops_at_once_saying_to_run_migrate(unmigrated, processes):
    # It ran on: hundreds of lines a second, tracebacks, and a wrong "the database is back".
    done = manage("runjobs", *processes, PGJOBS_TEST_DATABASE=unmigrated)
    assert done.returncode == 1
    assert done.stderr == (
        "CommandError: the pgjobs tables do not exist on the database 'default': run "
        "`manage.py migrate`, then start the worker again\n"
    )


def test_jobstats_before_migrate_is_critical_and_says_to_run_migrate(unmigrated):
    done = manage("jobstats", PGJOBS_TEST_DATABASE=unmigrated)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("verdict: CRITICAL: the pgjobs tables are missing")
    assert "run `manage.py migrate` on the database 'default'" in done.stdout
    assert (len(done.stdout.splitlines()), done.stderr) == (1, "")


def test_the_deploy_checks_before_migrate_list_the_migrations_without_a_traceback(unmigrated):
    done = manage("check", "--deploy", "--database", "default", PGJOBS_TEST_DATABASE=unmigrated)
    assert "Traceback" not in done.stderr, done.stderr
    names = sorted(path.stem for path in (ROOT / "django_pgjobs/migrations").glob("0*.py"))
    assert (
        f"(pgjobs.W025) {len(names)} migrations of django-pgjobs are not applied on the database "
        f"'default' ({', '.join(names[:3])} and {len(names) - 3} more)"
    ) in done.stderr
    assert "HINT: Run `manage.py migrate`" in done.stderr


def down_url() -> str:
    """A DATABASE_URL whose server is down: port 1, where nothing listens. Not a free port
    picked now, which a server another test starts meanwhile may take (a NATS or PostgreSQL
    server of a parallel test would make a connect hang, not fail)."""
    return f"postgres://postgres@127.0.0.1:1/{connection_kwargs()['dbname']}"


def test_jobstats_with_the_database_down_is_critical_in_one_line():
    url = down_url()
    done = manage("jobstats", DATABASE_URL=url)
    assert done.returncode == 2  # critical: the monitoring plugin's 1 would be a mere warning
    assert done.stdout.startswith("verdict: CRITICAL: the database 'default' cannot be used: ")
    assert "Connection refused" in done.stdout
    assert (len(done.stdout.splitlines()), done.stderr) == (1, "")
    as_json = manage("jobstats", "--json", DATABASE_URL=url)
    assert as_json.returncode == 2
    assert '"status": "critical"' in as_json.stdout


@pytest.mark.parametrize("args", [["--watch", "0"], ["--watch", "soon"], ["--no-such-option"]])
def test_jobstats_with_a_bad_command_line_exits_unknown_not_critical(args):
    done = manage("jobstats", *args)
    assert done.returncode == 3
    assert "jobstats: error: " in done.stderr


def test_jobstats_watch_goes_on_through_an_outage_and_exits_with_the_last_samples_status():
    url = down_url()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": url}
    with subprocess.Popen(
        [sys.executable, "manage.py", "jobstats", "--watch", "0.1"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as in a terminal: a background job of a non-interactive shell (CI's second
        # leg) starts with SIGINT ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as watch:  # fmt: skip
        assert watch.stdout is not None and watch.stderr is not None
        lines = [watch.stdout.readline() for _ in range(3)]  # three samples: it did not stop
        watch.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            assert watch.wait(30) == 2
        except subprocess.TimeoutExpired:
            watch.kill()
            printed = watch.communicate()
            raise AssertionError(f"jobstats --watch ignored Ctrl-C: {printed}") from None
        assert "Traceback" not in watch.stderr.read()
    critical = "verdict: CRITICAL: the database 'default' cannot be used: "
    assert all(line.startswith(critical) for line in lines), lines
