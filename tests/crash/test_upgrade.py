"""Upgrading an existing install: `manage.py migrate` from an older schema, with jobs in it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import connection_kwargs
from tests.crash.conftest import manage as run_manage
from tests.crash.conftest import scratch_database


@pytest.fixture
def old_install(transactional_db: None) -> Iterator[str]:
    """A database of its own, migrated up to 0006 (before claims and scheduled jobs)."""
    with scratch_database("upgrade") as name:
        assert manage(name, "migrate", "pgjobs", "0006").returncode == 0
        yield name


def manage(database: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_manage(*args, PGJOBS_TEST_DATABASE=database)


def test_an_install_from_before_claims_upgrades_with_migrate_and_its_waiting_jobs_move(old_install):
    with psycopg.connect(**{**connection_kwargs(), "dbname": old_install}) as old:
        old.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, run_at) "
            "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3, at "
            "FROM unnest(ARRAY[now() + interval '1 hour', now()]) AS at"
        )

    # The new code against the old schema: one line saying what to do, not a traceback loop.
    once = manage(old_install, "runjobs", "--once")
    assert once.returncode == 1
    assert "run `manage.py migrate`" in once.stderr, once.stderr

    # The system checks must not stop the migration that builds what they look for.
    upgrade = manage(old_install, "migrate")
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    assert manage(old_install, "check", "--database", "default").returncode == 0

    with psycopg.connect(**{**connection_kwargs(), "dbname": old_install}) as new:
        rows = new.execute(
            "SELECT run_at > now(), scheduled, claims FROM pgjobs_job ORDER BY run_at"
        ).fetchall()
        assert rows == [(False, False, 0), (True, True, 0)]  # the waiting one moved
        invalid = new.execute(
            "SELECT count(*) FROM pg_index WHERE indrelid = 'pgjobs_job'::regclass "
            "AND NOT indisvalid"
        ).fetchone()
        assert invalid == (0,)
    done = manage(old_install, "runjobs", "--once")
    assert done.returncode == 0, done.stderr
