"""Query plans: EXPLAIN a statement on the test's connection, then find the nodes that matter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

Plan = dict[str, Any]


def explain(
    sql: str, params: object = None, *, analyze: bool = False, buffers: bool = False
) -> Plan:
    """The root node of `sql`'s plan (EXPLAIN (FORMAT JSON)). With `analyze` the statement
    runs, inside a transaction (or savepoint) that is rolled back, so it changes nothing; with
    `buffers` too, each node counts the buffers it read."""
    options = ", ".join(
        name for name, wanted in (("ANALYZE", analyze), ("BUFFERS", buffers)) if wanted
    )
    options = f"{options}, FORMAT JSON" if options else "FORMAT JSON"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN ({options}) {sql}", params)
        (document,) = cursor.fetchone()
        transaction.set_rollback(True)
    parsed = json.loads(document) if isinstance(document, str) else document
    return parsed[0]["Plan"]


def nodes(plan: Plan) -> Iterator[Plan]:
    """Every node of the plan, the root first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def of_type(plan: Plan, node_type: str) -> list[Plan]:
    """The nodes of one type ("Sort", "Seq Scan", ...); a parallel scan counts as its type."""
    return [node for node in nodes(plan) if node["Node Type"] == node_type]


def index_scans(plan: Plan, index: str) -> list[Plan]:
    """The nodes that read `index` (index, index-only and bitmap index scans alike)."""
    return [node for node in nodes(plan) if node.get("Index Name") == index]


def shown(plan: Plan) -> str:
    """The plan as text for an assertion's message."""
    return json.dumps(plan, indent=1)


def sequential_scans(other: Any) -> int:
    """How many times the job table was read whole so far, the reads of the test's own
    connection included (it writes its counters when it goes idle, once asked to); `other`:
    another session, which reads them."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    query = "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'"
    return int(other.execute(query).fetchone()[0])


@contextmanager
def planned_once_on_an_empty_table(other: Any) -> Iterator[None]:
    """The test's connection set up as a worker's main loop's (prepared, planned once) on an
    emptied, analysed job table, with autovacuum off there (as it is, in effect, for the minute
    before it next looks): what a worker started on an empty table plans; undone after."""
    from django_pgjobs.runtime.sessions import LockWaits, application_name

    other.execute("ALTER TABLE pgjobs_job SET (autovacuum_enabled = false)")
    other.execute("VACUUM ANALYZE pgjobs_job")
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread(plans=True)
        yield
    finally:
        sessions.stop()
        other.execute("ALTER TABLE pgjobs_job RESET (autovacuum_enabled)")
        connection.close()
