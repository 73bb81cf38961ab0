"""Whether the pgjobs tables are there: the error a database without them (``manage.py
migrate`` not run, or not since an upgrade) raises, said as what to do, and the migrations of
this app not applied yet."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import ProgrammingError, connections
from django.db.migrations.loader import MigrationLoader

from django_pgjobs.errors import NotMigrated, first_line

#: The app label whose migrations build the tables (models.py's app_label).
APP_LABEL = "pgjobs"

#: SQLSTATEs of a missing table (42P01) or column (42703).
UNDEFINED = ("42P01", "42703")


def is_not_migrated(error: BaseException) -> bool:
    """Whether `error` is a table or column that does not exist (yet): met by pgjobs's own
    statements, a pgjobs table or column not migrated."""
    if isinstance(error, NotMigrated):
        return True
    return (
        isinstance(error, ProgrammingError)
        and getattr(error.__cause__, "sqlstate", None) in UNDEFINED
    )


def explained(error: BaseException) -> str:
    """One line for a missing table or column: what is wrong and what to do."""
    first = first_line(error)
    if isinstance(error, NotMigrated):
        return first
    return f"the pgjobs tables are missing or out of date ({first}): run `manage.py migrate`"


@contextmanager
def migrated() -> Iterator[None]:
    """Raise NotMigrated, saying to run migrate, for a pgjobs table or column that does not
    exist; other errors pass unchanged."""
    try:
        yield
    except ProgrammingError as error:
        if is_not_migrated(error) and not isinstance(error, NotMigrated):
            raise NotMigrated(explained(error)) from error
        raise


def pending_migrations(alias: str) -> list[str]:
    """This app's migrations that are not applied on the database `alias`, oldest first."""
    loader = MigrationLoader(connections[alias])
    ours = sorted(key for key in loader.graph.nodes if key[0] == APP_LABEL)
    return [name for app, name in ours if (app, name) not in loader.applied_migrations]
