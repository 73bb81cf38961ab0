"""What the worker's hot path does to save CPU, and that nothing else changes: jsonb columns
loaded without the JSON parser for their common values, the collector's passes during a run."""

from __future__ import annotations

import gc
import json

import pytest
from django.db import connection
from psycopg.types.json import set_json_loads

from django_pgjobs.data import rows
from django_pgjobs.models import Job
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.worker import Worker
from tests import tasks

VALUES = ["{}", "[]", "null", '{"n": 1, "s": "é"}', "[1, [], {}]", '""', "0"]


@pytest.mark.django_db
def test_jsonb_columns_load_as_the_json_parser_loads_them():
    statement = "SELECT " + ", ".join(f"%(v{n})s::jsonb" for n in range(len(VALUES)))
    params = {f"v{n}": value for n, value in enumerate(VALUES)}
    (row,) = rows.execute("default", statement, params, binary=True)
    assert list(row) == [json.loads(value) for value in VALUES]


@pytest.mark.django_db
def test_each_empty_jsonb_object_or_array_loaded_is_a_new_one():
    found = rows.execute(
        "default", "SELECT '{}'::jsonb, '[]'::jsonb FROM generate_series(1, 2)", {}, binary=True
    )
    (first_object, first_array), (second_object, second_array) = found
    first_object["changed"] = True
    first_array.append(1)
    assert (second_object, second_array) == ({}, [])


@pytest.mark.django_db
def test_a_json_loads_set_on_the_connection_is_kept():
    connection.ensure_connection()
    set_json_loads(lambda data: {"loaded by": "mine"}, connection.connection)
    try:
        (row,) = rows.execute("default", "SELECT '{}'::jsonb, '[1]'::jsonb", {}, binary=True)
    finally:
        connection.close()  # the next test gets a connection without it
    assert list(row) == [{"loaded by": "mine"}] * 2


@pytest.mark.django_db
def test_a_json_loads_set_for_every_connection_is_kept():
    set_json_loads(lambda data: {"loaded by": "mine"})
    try:
        (row,) = rows.execute("default", "SELECT '{}'::jsonb, '[1]'::jsonb", {}, binary=True)
    finally:
        set_json_loads(json.loads)
    assert list(row) == [{"loaded by": "mine"}] * 2


@pytest.mark.django_db(transaction=True)
def test_a_worker_leaves_what_existed_before_it_out_of_the_collectors_passes_while_it_runs():
    before = gc.get_freeze_count()  # Python 3.12 starts with a few hundred objects frozen
    tasks.frozen_while_running.clear()
    Job.objects.enqueue("tests.tasks.counts_frozen")
    Worker(Options(queues=["default"], once=True, listen=False, concurrency=1)).run()
    (frozen,) = tasks.frozen_while_running
    assert frozen > before
    # Collectable again once it stopped: gc.unfreeze() gives back everything frozen, what was
    # frozen before the worker too (so this failed on Python 3.12 whenever this worker was
    # its process's first).
    assert gc.get_freeze_count() == 0
