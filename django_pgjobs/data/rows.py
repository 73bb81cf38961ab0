"""Cursor and row plumbing for the hot path: server-side binding, binary results, Job loading."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections, models
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

if TYPE_CHECKING:
    from django_pgjobs.models import Job


@contextmanager
def cursor(db: str, binary: bool = False) -> Iterator[Any]:
    """A Django cursor on `db` that binds parameters on the server, for the hot path.

    Arrays of ids travel as binary parameters instead of being quoted into the SQL by Python,
    and psycopg prepares statements it sees often when the connection allows it (Django's
    OPTIONS["prepare_threshold"]; off by default, which PgBouncer in transaction mode needs).
    With `binary`, results load in C (uuids, timestamps, jsonb) rather than by parsing text.
    It is Django's cursor wrapper all the same: error translation, execute wrappers and query
    logging (assertNumQueries, the debug toolbar) see these statements like any other.
    """
    wrapper = connections[db]
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    wrapper.validate_thread_sharing()
    raw: Any = psycopg.Cursor(wrapper.connection)
    if binary:
        raw.format = psycopg.pq.Format.BINARY
    wrapped = wrapper.make_debug_cursor(raw) if wrapper.queries_logged else wrapper.make_cursor(raw)
    with wrapped:
        yield wrapped


def execute(db: str, sql: str, params: dict[str, Any], binary: bool = False) -> list[Any]:
    """Run one statement on `db` and return all its rows."""
    with cursor(db, binary) as raw:
        raw.execute(sql, params)
        return list(raw.fetchall())


@lru_cache(maxsize=8)
def _loading(model: type[Job]) -> tuple[list[str], list[tuple[int, Any]]]:
    """The model's attribute names, and the fields whose database values need converting.

    Rows come in binary, where psycopg has already loaded jsonb into Python objects, so JSON
    fields need no converting (Django's converter parses only the text format)."""
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
    jobs = []
    for row in rows:
        values = list(row)
        for n, field in converters:
            values[n] = field.from_db_value(values[n], None, connection)
        jobs.append(_instance(model, db, attnames, values))
    return jobs


def new_job(model: type[Job], db: str, values: Sequence[Any]) -> Job:
    """A Job instance from every column's value in model order, without a query."""
    return _instance(model, db, _loading(model)[0], values)


def _instance(model: type[Job], db: str, attnames: list[str], values: Sequence[Any]) -> Job:
    """What `model.from_db(db, attnames, values)` returns, for a row with every column, built
    without Model.__init__: that walks every field again and was a third of the Python a job
    cost on the hot path. Through from_db when something listens to the model's init signals,
    so their receivers still run."""
    if pre_init.has_listeners(model) or post_init.has_listeners(model):
        return model.from_db(db, attnames, values)
    job = model.__new__(model)
    # The fields' descriptors (DeferredAttribute) do not intercept setting: __init__ fills
    # the instance's __dict__ just the same.
    job.__dict__.update(zip(attnames, values, strict=True))
    state = ModelState()
    state.adding = False
    state.db = db
    job._state = state
    return job
