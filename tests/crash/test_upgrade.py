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


def _indexes(database: str) -> dict[str, tuple[int, bool, str]]:
    """The job table's indexes: name -> (oid, valid, definition)."""
    with psycopg.connect(**{**connection_kwargs(), "dbname": database}) as session:
        rows = session.execute(
            "SELECT c.relname, c.oid, i.indisvalid, pg_get_indexdef(c.oid) FROM pg_index AS i "
            "JOIN pg_class AS c ON c.oid = i.indexrelid WHERE i.indrelid = 'pgjobs_job'::regclass"
        ).fetchall()
    return {name: (oid, valid, definition) for name, oid, valid, definition in rows}


def _forget_0012(database: str) -> None:
    with psycopg.connect(**{**connection_kwargs(), "dbname": database}, autocommit=True) as db:
        db.execute(
            "DELETE FROM django_migrations WHERE app = 'pgjobs' AND name = '0012_scheduled_indexes'"
        )


def test_an_install_whose_0008_built_the_scheduled_indexes_keeps_them(old_install):
    # An earlier release's 0008 built what 0012 builds now: the same schema, 0012 not recorded
    # (nor anything after it).
    assert manage(old_install, "migrate", "pgjobs", "0012").returncode == 0
    built = _indexes(old_install)
    _forget_0012(old_install)

    upgrade = manage(old_install, "migrate", "pgjobs", "0012")
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    assert "Applying pgjobs.0012_scheduled_indexes... OK" in upgrade.stdout
    assert _indexes(old_install) == built  # the same indexes, none built again


def test_scheduled_indexes_stopped_part_way_are_finished_by_the_next_migrate(old_install):
    assert manage(old_install, "migrate", "pgjobs", "0012").returncode == 0
    with psycopg.connect(**{**connection_kwargs(), "dbname": old_install}, autocommit=True) as db:
        db.execute(
            "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts) "
            "SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', 3 "
            "FROM generate_series(1, 2)"
        )
        # As a run stops: the scheduled index's build failed half-way (left invalid) ...
        db.execute("DROP INDEX pgjobs_job_scheduled_idx")
        with pytest.raises(psycopg.errors.UniqueViolation):
            db.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY pgjobs_job_scheduled_idx ON pgjobs_job (queue)"
            )
        # ... and the old claim index was dropped before the new one took its name.
        db.execute("ALTER INDEX pgjobs_job_claim_idx RENAME TO pgjobs_job_claim_new")
    assert _indexes(old_install)["pgjobs_job_scheduled_idx"][1] is False
    _forget_0012(old_install)

    again = manage(old_install, "migrate")
    assert again.returncode == 0, again.stdout + again.stderr
    indexes = _indexes(old_install)
    assert "pgjobs_job_claim_new" not in indexes
    assert "NOT scheduled" in indexes["pgjobs_job_claim_idx"][2]
    assert "INCLUDE (queue) WHERE (scheduled AND" in indexes["pgjobs_job_scheduled_idx"][2]
    assert all(valid for _, valid, _ in indexes.values()), indexes
    assert manage(old_install, "check", "--database", "default").returncode == 0
