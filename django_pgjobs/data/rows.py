"""Cursor and row plumbing for the hot path: server-side binding, binary results and COPY,
Job loading."""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
from django.db import (
    DatabaseError,
    InterfaceError,
    InternalError,
    OperationalError,
    connections,
    models,
)
from django.db.backends.utils import CursorDebugWrapper
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from psycopg.abc import Buffer
from psycopg.types.array import ListBinaryDumper
from psycopg.types.json import JsonbBinaryLoader, set_json_dumps

if TYPE_CHECKING:
    from django_pgjobs.models import Job

logger = logging.getLogger(__name__)


#: How old plans must be before a backlog has them made again (see replan).
REPLAN_AFTER = 1.0

#: How old plans may grow while there is no backlog (see replan).
REPLAN_IDLE = 30.0

#: Connections that plan once (see plan_once): each one's plans' generation and its start.
_PLANNED_ONCE: weakref.WeakKeyDictionary[Any, tuple[int, float]] = weakref.WeakKeyDictionary()


def plan_once(connection: psycopg.Connection[Any]) -> None:
    """Mark `connection` as planning its prepared statements once for any parameters: the
    statements `cursor` runs on it carry their plans' generation, which `replan` moves on."""
    _PLANNED_ONCE[connection] = (0, time.monotonic())


def replan(db: str, backlog: bool) -> None:
    """Have the statements of `db`'s connection (in this thread) planned again if it plans
    once and its plans are older than REPLAN_AFTER with a `backlog` (the worker's turn came
    back full), or older than REPLAN_IDLE without one.

    A cached plan is remade only when autovacuum analyzes the table, too late for a backlog
    that arrives within a second: a plan made on a nearly empty table would read it whole.
    Idle plans age longer because an idle worker's wake-ups would pay for each new generation.
    """
    connection = connections[db].connection
    if connection is None:
        return
    generation, since = _PLANNED_ONCE.get(connection, (-1, 0.0))
    age = time.monotonic() - since
    if generation >= 0 and age >= (REPLAN_AFTER if backlog else REPLAN_IDLE):
        _PLANNED_ONCE[connection] = (generation + 1, time.monotonic())


def plans_once() -> bool:
    """False once a worker's prepared statements went missing (see _give_up_plans)."""
    return not _POOLED


_POOLED = False


#: What psycopg raises when a prepared statement went missing, or another of its name is there.
_PREPARED_GONE = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)


def _give_up_plans(connection: psycopg.Connection[Any], error: Exception) -> None:
    """A statement prepared on `connection` went missing, or another of the same name was
    there: an unannounced transaction-mode pooler. This process prepares nothing more (see
    plans_once) and says what to set."""
    global _POOLED
    if not _POOLED:
        _POOLED = True
        logger.warning(
            "a prepared statement of this worker's went missing (%s): the database is reached "
            "through a transaction-mode pooler. The worker prepares no more statements; set "
            "DISABLE_SERVER_SIDE_CURSORS = True in DATABASES, as Django asks for such a pooler "
            "(see docs/howto/pgbouncer.md)",
            str(error).strip().splitlines()[0],
        )
    connection.prepare_threshold = None
    _PLANNED_ONCE.pop(connection, None)


class _Replanned(psycopg.Cursor[Any]):
    """A cursor whose statements are new to the plan cache in each generation of plans."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        generation, _ = _PLANNED_ONCE.get(self.connection, (0, 0.0))
        return super().execute(f"{query}/* plans {generation} */", params, **kwargs)


@contextmanager
def cursor(db: str, binary: bool = False) -> Iterator[Any]:
    """A Django cursor on `db` that binds parameters on the server, for the hot path; with
    `binary`, results load in C rather than by parsing text. It is Django's cursor wrapper all
    the same: error translation, execute wrappers and query logging see its statements."""
    wrapper = connections[db]
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    wrapper.validate_thread_sharing()
    factory = _Replanned if wrapper.connection in _PLANNED_ONCE else psycopg.Cursor
    raw: Any = factory(wrapper.connection)
    if binary:
        raw.format = psycopg.pq.Format.BINARY
        if raw.adapters.get_loader(JSONB_OID, BINARY) is JsonbBinaryLoader:  # not customised
            raw.adapters.register_loader(JSONB_OID, _JsonbLoader)
    wrapped = wrapper.make_debug_cursor(raw) if wrapper.queries_logged else wrapper.make_cursor(raw)
    with wrapped:
        try:
            yield wrapped
        except DatabaseError as error:
            if isinstance(error.__cause__, _PREPARED_GONE) and factory is _Replanned:
                _give_up_plans(wrapper.connection, error)
            raise


def connection_lost(error: DatabaseError) -> bool:
    """Whether `error` says the connection, not the statement, is at fault (gone or broken, a
    prepared statement missing or unfit, a database that refuses writes): what the statement
    was to do is then tried again, unchanged, on a new connection."""
    return (
        isinstance(error, OperationalError | InterfaceError)
        or isinstance(error.__cause__, _PREPARED_GONE)
        or plan_unfit(error)
        or refuses_writes(error)
    )


def refuses_writes(error: DatabaseError) -> bool:
    """Whether `error` is the database refusing a write (a standby, or transaction_read_only
    on): after a failover, a new connection to the same address may reach the new primary."""
    return isinstance(error.__cause__, psycopg.errors.ReadOnlySqlTransaction)


def check_writable(db: str) -> None:
    """Raise the DatabaseError of refuses_writes when `db` refuses writes (a turn that wrote
    nothing cannot tell a standby from the primary)."""
    with connections[db].cursor() as cursor:
        cursor.execute(
            "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
        )
        (refuses,) = cursor.fetchone()
    if refuses:
        cause = psycopg.errors.ReadOnlySqlTransaction(
            "it is in recovery, or transaction_read_only is on"
        )
        raise InternalError(str(cause)) from cause


def timed_out(error: DatabaseError) -> bool:
    """Whether `error` is a statement that ran out of time (a lock_timeout, a
    statement_timeout): the statement's failure, not the connection's."""
    return isinstance(
        error.__cause__, psycopg.errors.LockNotAvailable | psycopg.errors.QueryCanceled
    )


def lock_waited_out(error: DatabaseError) -> bool:
    """Whether `error` is a statement that waited its lock_timeout for a lock held elsewhere
    (not a statement_timeout: nothing need be locked for that)."""
    return isinstance(error.__cause__, psycopg.errors.LockNotAvailable)


def rolled_back(error: DatabaseError) -> bool:
    """Whether `error` is the database rolling a transaction back to keep its guarantees (a
    serialization failure, a deadlock: SQLSTATE class 40), which a retry may get past."""
    return str(getattr(error.__cause__, "sqlstate", None) or "").startswith("40")


def plan_unfit(error: DatabaseError) -> bool:
    """Whether `error` is PostgreSQL refusing a prepared statement whose result a migration
    changed (the type of a column it returns)."""
    cause = error.__cause__
    return isinstance(cause, psycopg.errors.FeatureNotSupported) and (
        "cached plan must not change result type" in str(cause)
    )


def execute(db: str, sql: str, params: dict[str, Any], binary: bool = False) -> list[Any]:
    """Run one statement on `db` and return all its rows. Lists are sent in the binary format
    (no quoting of every element); every list in data/sql.py is cast to its array type."""
    with cursor(db, binary) as raw:
        if any(isinstance(value, list) for value in params.values()):
            raw.cursor.adapters.register_dumper(list, ListBinaryDumper)
        raw.execute(sql, params)
        return list(raw.fetchall())


def copy(db: str, statement: str, types: Sequence[str], records: Iterable[Sequence[Any]]) -> None:
    """Run `statement`, a ``COPY … FROM STDIN (FORMAT BINARY)``, on `db` with `records`, whose
    values are of the PostgreSQL `types`; jsonb values are JSON text, sent as it is. Like
    `execute`, through Django's cursor wrapper (without parameters)."""
    with cursor(db) as wrapped:
        raw = wrapped.cursor
        set_json_dumps(_as_is, raw)

        def run(sql: str, params: Any, many: bool, context: Any) -> None:
            with wrapped.db.wrap_database_errors, raw.copy(sql) as stream:
                stream.set_types(types)
                for record in records:
                    stream.write_row(record)

        logged = isinstance(wrapped, CursorDebugWrapper)
        with wrapped.debug_sql(statement) if logged else nullcontext():
            wrapped._execute_with_wrappers(statement, None, False, executor=run)


def _as_is(text: str) -> str:
    return text


JSONB_OID = 3802
BINARY = psycopg.pq.Format.BINARY


class Unreadable:
    """A jsonb value Python's JSON parser refused: an integer of more than 4,300 digits, or
    nesting deeper than its recursion limit. Enqueue refuses both; a row written by other means
    (SQL, another program) may hold one, and must not fail every claim that takes it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"[:300]

    def __repr__(self) -> str:
        return f"<unreadable JSON: {self.error}>"


class _JsonbLoader(JsonbBinaryLoader):
    """psycopg's binary jsonb loader, making the empty payload and error history most rows hold
    without the JSON parser. A value the parser refuses loads as Unreadable: a claim's rows are
    read after it committed, and one failing its read would strand every job claimed with it."""

    def load(self, data: Buffer) -> Any:
        if self.loads is json.loads:  # not psycopg.types.json.set_json_loads()'s own
            if data == b"\x01{}":
                return {}
            if data == b"\x01[]":
                return []
        try:
            return super().load(data)
        except (ValueError, RecursionError) as error:
            return Unreadable(error)


@lru_cache(maxsize=8)
def _loading(model: type[Job]) -> tuple[list[str], list[tuple[int, Any]]]:
    """The model's attribute names, and the fields whose database values need converting
    (not JSON fields: binary rows come with jsonb already loaded)."""
    fields = model._meta.concrete_fields
    converters = [
        (n, field)
        for n, field in enumerate(fields)
        if hasattr(field, "from_db_value") and not isinstance(field, models.JSONField)
    ]
    return [field.attname for field in fields], converters


def load_jobs(model: type[Job], db: str, rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from binary result rows with every column in model order (sql.JOB_COLUMNS)."""
    attnames, converters = _loading(model)
    connection = connections[db]
    plain = _plainly_built(model)  # see new_jobs
    jobs = []
    for row in rows:
        values = row
        if converters:  # none for Job's own fields: its rows are used as they come
            values = list(row)
            for n, field in converters:
                values[n] = field.from_db_value(values[n], None, connection)
        if plain:
            jobs.append(_built(model, db, dict(zip(attnames, values, strict=True))))
        else:
            jobs.append(model.from_db(db, attnames, values))
    return jobs


def new_jobs(
    model: type[Job],
    db: str,
    columns: Mapping[str, Any],
    ids: Iterable[UUID],
    payloads: Iterable[Any],
) -> Iterator[Job]:
    """Job instances as `model.from_db` makes them from `db`, one per id and payload, every
    other column from `columns` (each its own copy of a list or dict), made lazily; without
    Model.__init__, the bulk of the cost, when nothing could tell (see _plainly_built)."""
    attnames = _loading(model)[0]
    plain = _plainly_built(model)
    shared = {name: value for name, value in columns.items() if isinstance(value, list | dict)}
    for job_id, payload in zip(ids, payloads, strict=True):
        values = {**columns, "id": job_id, "payload": payload}
        for name, value in shared.items():
            values[name] = value.copy()
        if not plain:
            yield model.from_db(db, attnames, [values[name] for name in attnames])
            continue
        yield _built(model, db, values)


def _built(model: type[Job], db: str, values: dict[str, Any]) -> Job:
    """The instance from_db would make from `values` (every attribute by name), without
    Model.__init__; `values` becomes its __dict__."""
    job = object.__new__(model)
    state = ModelState()
    state.adding, state.db = False, db
    values["_state"] = state
    job.__dict__ = values
    return job


def _plainly_built(model: type[Job]) -> bool:
    """Whether Model.from_db would do nothing but set the instance's state and attributes."""
    return (
        model.__init__ is models.Model.__init__
        and model.from_db.__func__ is models.Model.from_db.__func__  # type: ignore[attr-defined]
        and not pre_init.has_listeners(model)
        and not post_init.has_listeners(model)
    )
