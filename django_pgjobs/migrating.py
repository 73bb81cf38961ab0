"""Migration operations for a busy job table, so that one plain ``manage.py migrate`` is safe
while jobs are enqueued and claimed.

Two kinds of schema change, never in one migration:

- `BoundedLockWait`: a change that needs a strong lock on the table (ADD COLUMN, DROP COLUMN,
  most ALTER TABLE). Its lock request queues behind every transaction holding any lock on the
  table, and every enqueue, claim and heartbeat queues behind the request. So it waits at most
  LOCK_TIMEOUT, gives the lock up, lets the queue run for PAUSE, and tries again.
- `CreateIndexConcurrently` and `ReplaceIndexConcurrently`: index builds that lock out no
  writer but wait, unbounded, for older transactions; outside a transaction and without a lock
  timeout, which would stop them part-way. They can be run again from wherever they stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import NotSupportedError, OperationalError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.operations.base import Operation
from django.db.migrations.state import ProjectState

logger = logging.getLogger(__name__)

#: How long one try waits for its lock: an enqueue that arrives behind it waits no longer.
LOCK_TIMEOUT = "500ms"
#: Seconds between tries, while enqueues and claims run.
PAUSE = 1.5
#: Tries before the step is rolled back and migrate fails (about ten minutes).
TRIES = 300

#: SQLSTATE of a lock wait cut short by lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"

# The session holding a lock on the table in its oldest transaction: the likeliest culprit.
OLDEST_HOLDER = """
    SELECT a.pid, a.state, extract(epoch FROM clock_timestamp() - a.xact_start),
           left(regexp_replace(a.query, '\\s+', ' ', 'g'), 200)
    FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid()
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.relation = to_regclass(%s)
    ORDER BY a.xact_start NULLS LAST
    LIMIT 1
"""


class LockNotFree(OperationalError):
    """A `BoundedLockWait` step gave up: its lock stayed held through every try."""


class BoundedLockWait(Operation):
    """Run `operations` (AddField, RunSQL, ...) as one step whose lock waits last at most
    LOCK_TIMEOUT; while a lock it needs is held, the step is rolled back, logged with the holder,
    and tried again after PAUSE, up to TRIES times; then it raises LockNotFree."""

    reduces_to_sql = True

    def __init__(self, *operations: Operation, table: str = "pgjobs_job") -> None:
        if not operations:
            raise TypeError("BoundedLockWait needs at least one operation to run")
        self.operations = operations
        self.table = table

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        for operation in self.operations:
            operation.state_forwards(app_label, state)

    def database_forwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        def forwards() -> None:
            state = from_state
            for operation in self.operations:
                after = state.clone()
                operation.state_forwards(app_label, after)
                operation.database_forwards(app_label, schema_editor, state, after)
                state = after

        self._in_short_tries(schema_editor, forwards)

    def database_backwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        def backwards() -> None:
            states = [to_state]  # the state before each operation, then after the last
            for operation in self.operations:
                after = states[-1].clone()
                operation.state_forwards(app_label, after)
                states.append(after)
            for index in reversed(range(len(self.operations))):
                self.operations[index].database_backwards(
                    app_label, schema_editor, states[index + 1], states[index]
                )

        self._in_short_tries(schema_editor, backwards)

    def describe(self) -> str:
        return "; ".join(_described(operation) for operation in self.operations)

    def _in_short_tries(
        self, schema_editor: BaseDatabaseSchemaEditor, step: Callable[[], None]
    ) -> None:
        if schema_editor.collect_sql:  # sqlmigrate: the statements only
            step()
            return
        connection = schema_editor.connection
        started = time.monotonic()
        for attempt in range(1, TRIES + 1):
            deferred = len(schema_editor.deferred_sql)
            try:
                with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT current_setting('lock_timeout'), "
                        "set_config('lock_timeout', %s, true)",
                        [LOCK_TIMEOUT],
                    )
                    before = cursor.fetchone()[0]
                    step()
                    # The rest of the migration's transaction keeps the project's setting.
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [before])
                return
            except OperationalError as error:
                if getattr(error.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                del schema_editor.deferred_sql[deferred:]  # queued by the try rolled back
                holder = _holder(connection, self.table)
                if attempt == TRIES:
                    raise LockNotFree(
                        f"pgjobs migration step ({self.describe()}) gave up waiting for a "
                        f"lock on {self.table} after {TRIES} tries in "
                        f"{time.monotonic() - started:.0f} s: {holder}. The step was rolled "
                        "back; run `manage.py migrate` again once that transaction has ended."
                    ) from error
                logger.warning(
                    "pgjobs migration step (%s) waits for a lock on %s: %s; trying again in "
                    "%g s (try %d of %d)", self.describe(), self.table, holder, PAUSE,
                    attempt, TRIES,
                )  # fmt: skip
                time.sleep(PAUSE)


def _described(operation: Operation) -> str:
    """An operation in a few words: a RunSQL by its statement's start."""
    sql = getattr(operation, "sql", None)
    if isinstance(sql, str):
        return " ".join(sql.split())[:100]
    return operation.describe()


def _holder(connection: BaseDatabaseWrapper, table: str) -> str:
    """Who holds a lock on `table` in the oldest transaction, said for an operator."""
    with connection.cursor() as cursor:
        cursor.execute(OLDEST_HOLDER, [table])
        row = cursor.fetchone()
    if row is None:
        return f"no session holds a lock on {table} any more"
    pid, state, seconds, query = row
    opened = f", in a transaction open for {seconds:.0f} s" if seconds is not None else ""
    return f"pid {pid} holds one ({state}{opened}; its last statement: {query})"


class _ConcurrentIndex(Operation):
    """A database change only, run outside a transaction (a migration with atomic = False)."""

    atomic = False
    reduces_to_sql = True

    def state_forwards(self, app_label: str, state: ProjectState) -> None:
        pass


class CreateIndexConcurrently(_ConcurrentIndex):
    """Build the index `name` with `sql` (a CREATE INDEX CONCURRENTLY statement), unless a
    valid index of that name exists; an invalid one (a build that was interrupted) is dropped
    and built again. Pair it with the state's AddIndex in a SeparateDatabaseAndState."""

    def __init__(self, name: str, sql: str) -> None:
        if "CONCURRENTLY" not in sql.upper() or f'"{name}"' not in sql:
            raise ValueError(
                f'the sql of CreateIndexConcurrently("{name}") must be a CREATE INDEX '
                f'CONCURRENTLY statement naming the index "{name}" (in double quotes): {sql!r}'
            )
        self.name = name
        self.sql = sql

    def database_forwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        with _unbounded(self, schema_editor) as run:
            valid = _valid(schema_editor, self.name)
            if valid:
                return
            if valid is False:  # a build that was interrupted
                run(f'DROP INDEX CONCURRENTLY "{self.name}"')
            run(self.sql)

    def database_backwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        with _unbounded(self, schema_editor) as run:
            run(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.name}"')

    def describe(self) -> str:
        return f"Build the index {self.name} concurrently"


class ReplaceIndexConcurrently(_ConcurrentIndex):
    """Give the index `name` a new definition without locking writers out: `sql` (with
    ``{name}`` where the index's name goes) builds it under the name `building`, beside the old
    one; the old one is dropped and the new one renamed. An index `name` whose definition
    contains `marker` is the new one already, and is kept. Backwards, `reverse_sql` builds the
    old definition the same way."""

    def __init__(self, name: str, building: str, sql: str, reverse_sql: str, marker: str) -> None:
        for which, template in (("sql", sql), ("reverse_sql", reverse_sql)):
            if "CONCURRENTLY" not in template.upper() or '"{name}"' not in template:
                raise ValueError(
                    f'the {which} of ReplaceIndexConcurrently("{name}") must be a CREATE INDEX '
                    f'CONCURRENTLY statement with "{{name}}" for the index name: {template!r}'
                )
        self.name = name
        self.building = building
        self.sql = sql
        self.reverse_sql = reverse_sql
        self.marker = marker

    def database_forwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        with _unbounded(self, schema_editor) as run:
            if _valid(schema_editor, self.name, self.marker):
                run(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.building}"')  # a leftover
                return
            # A valid leftover of an interrupted run is kept only if it is the new definition.
            if not _valid(schema_editor, self.building, self.marker):
                run(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.building}"')
                run(self.sql.format(name=self.building))
            self._swap(run)

    def database_backwards(
        self, app_label: str, schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState, to_state: ProjectState,
    ) -> None:  # fmt: skip
        with _unbounded(self, schema_editor) as run:
            run(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.building}"')
            run(self.reverse_sql.format(name=self.building))
            self._swap(run)

    def _swap(self, run: Callable[[str], None]) -> None:
        # IF EXISTS: a run stopped after the drop (and before the rename) finds it gone.
        run(f'DROP INDEX CONCURRENTLY IF EXISTS "{self.name}"')
        run(f'ALTER INDEX "{self.building}" RENAME TO "{self.name}"')

    def describe(self) -> str:
        return f"Rebuild the index {self.name} concurrently"


@contextmanager
def _unbounded(
    operation: Operation, schema_editor: BaseDatabaseSchemaEditor
) -> Iterator[Callable[[str], None]]:
    """Runs the statements of a concurrent index operation with no lock or statement timeout
    (a build waits for older transactions, however long), then restores the session's."""

    def run(sql: str) -> None:
        schema_editor.execute(sql, params=None)

    if schema_editor.collect_sql:
        yield run
        return
    connection = schema_editor.connection
    if connection.in_atomic_block:
        raise NotSupportedError(
            f"{type(operation).__name__} cannot run inside a transaction: set atomic = False "
            "on its migration, and put no change that needs a strong lock in it"
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
            "set_config('lock_timeout', '0', false), set_config('statement_timeout', '0', false)"
        )
        lock_timeout, statement_timeout, *_ = cursor.fetchone()
    try:
        yield run
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('lock_timeout', %s, false), "
                "set_config('statement_timeout', %s, false)",
                [lock_timeout, statement_timeout],
            )


def _valid(schema_editor: BaseDatabaseSchemaEditor, name: str, marker: str = "") -> bool | None:
    """Whether the index `name` is valid (and its definition contains `marker`); None if it
    does not exist. Always None for sqlmigrate, which shows every statement."""
    if schema_editor.collect_sql:
        return None
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indisvalid AND strpos(pg_get_indexdef(indexrelid), %s) > 0 FROM pg_index "
            "WHERE indexrelid = to_regclass(%s)",
            [marker, f'"{name}"'],
        )
        row = cursor.fetchone()
    return None if row is None else bool(row[0])
