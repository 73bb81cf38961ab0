"""The migration operations for a busy job table (django_pgjobs.migrating), in this process."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, migrations
from django.db.migrations.state import ProjectState

from django_pgjobs import migrating

pytestmark = pytest.mark.django_db(transaction=True)

ADD_PROBE = migrations.RunSQL(
    "ALTER TABLE pgjobs_job ADD COLUMN probe integer", "ALTER TABLE pgjobs_job DROP COLUMN probe"
)


def _columns() -> list[str]:
    with connection.cursor() as cursor:
        return [
            c.name for c in connection.introspection.get_table_description(cursor, "pgjobs_job")
        ]


def test_a_step_whose_lock_stays_held_gives_up_naming_the_holder(
    other_connection: Any, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(migrating, "TRIES", 2)
    monkeypatch.setattr(migrating, "PAUSE", 0.1)
    other_connection.execute("BEGIN")
    other_connection.execute("SELECT count(*) FROM pgjobs_job")  # an ACCESS SHARE lock, held
    holder = other_connection.info.backend_pid
    try:
        with (
            pytest.raises(
                migrating.LockNotFree, match=rf"after 2 tries .*: pid {holder} holds one"
            ),
            connection.schema_editor() as editor,
        ):
            step = migrating.BoundedLockWait(ADD_PROBE)
            step.database_forwards("pgjobs", editor, ProjectState(), ProjectState())
    finally:
        other_connection.execute("ROLLBACK")
    assert "probe" not in _columns()


def test_a_step_leaves_the_projects_lock_timeout_to_the_rest_of_its_migration():
    class RolledBack(Exception):
        pass

    with pytest.raises(RolledBack), connection.schema_editor() as editor:  # atomic, as a migration
        editor.execute("SET LOCAL lock_timeout = '7s'")
        step = migrating.BoundedLockWait(ADD_PROBE)
        step.database_forwards("pgjobs", editor, ProjectState(), ProjectState())
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            assert cursor.fetchone() == ("7s",)
        assert "probe" in _columns()
        raise RolledBack
    assert "probe" not in _columns()
