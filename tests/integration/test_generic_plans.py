"""A worker's own connections plan each statement once, for any parameters
(plan_cache_mode force_generic_plan: runtime/sessions.py). Such a plan cannot know how many rows
a LIMIT or an array parameter stands for, so every statement of data/sql.py must be written
so that its generic plan still reads the job table by its indexes, never whole."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction

from django_pgjobs.data import sql
from tests.plans import Plan, nodes, shown

#: A value for every parameter name in data/sql.py: a statement with a new name fails below
#: until it is given one here.
SAMPLES: dict[str, Any] = {
    "after_id": [None], "after_priority": [None], "after_run_at": [None], "below": 1,
    "attempts": 1, "base": 1.0, "cap": 60.0, "channel": None, "claims": [1],
    "created_at": datetime(2026, 1, 1, tzinfo=UTC), "delay": 0.0, "delays": [1.0],
    "error": "{}", "errors": ["{}"], "errors_kept": "$[last - 9 to last]",
    "failed_claims": [1], "failed_ids": [uuid.uuid4()], "failed_progress": [None],
    "headers": None, "id": uuid.uuid4(), "ids": [uuid.uuid4()], "lease": 60.0, "limit": 100,
    "max_attempts": 3, "payload": "{}", "permanent": [False], "priority": 0,
    "progress": [None], "queue": "default", "queues": ["default"], "reason": "gone",
    "results": [None], "rooms": [100], "run_at": None, "spared_claims": [1],
    "spared_ids": [uuid.uuid4()],
    "succeeded_claims": [1], "succeeded_ids": [uuid.uuid4()], "succeeded_progress": [None],
    "summaries": ["boom"], "task": "tests.tasks.noop", "unique_key": None, "worker": "w1",
    "after_task": "", "after_key": "", "locking": ["tests.tasks.export"], "lock_class": 1,
    "tasks": ["tests.tasks.export"], "keys": ["c1"], "limited": ["tests.tasks.export"],
    "concurrency": [2], "every": [None], "burst": [None], "limit_key": None, "scan": 200,
    "status": "ready", "batch": None, "batches": [uuid.uuid4()], "jobs": [uuid.uuid4()],
    "waiters": [uuid.uuid4()], "job": uuid.uuid4(), "size": 1, "on_complete": None,
    "on_success": None, "older_than": 60.0, "after": uuid.uuid4(),
}  # fmt: skip

#: Where one name stands for a value of another shape.
SAMPLES_OF = {"WRITE_BACK": {"errors": "[]", "claims": 1}, "REVIVABLE_JOBS": {"after": 0}}

#: Run through Django's own cursor, which binds on the client: never planned without values.
CLIENT_BOUND = {"LOCK_QUEUE", "QUEUE_CONTROLLED", "COUNT_RUNNING", "SPEND_QUEUE_RATE"}

STATEMENTS = {
    name: text
    for name, text in vars(sql).items()
    if name.isupper()
    and not name.startswith("_")  # a template
    and isinstance(text, str)
    and "%(" in text
    and name not in CLIENT_BOUND
} | {f"INSERT_JOBS{case}": text for case, text in sql.INSERT_JOBS.items()}


def generic_plan(statement: str, samples: dict[str, Any]) -> Plan:
    """The plan PostgreSQL makes of `statement` once for any parameters, as EXPLAIN EXECUTE
    shows it under force_generic_plan (EXPLAIN of a statement with parameters plans it for
    their values instead)."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}", statement)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE pgjobs_generic AS {numbered}")
        values = [samples[name] for name in names]
        placeholders = ", ".join(["%s"] * len(values))
        cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE pgjobs_generic({placeholders})", values)
        (document,) = cursor.fetchone()
        cursor.execute("DEALLOCATE pgjobs_generic")
        transaction.set_rollback(True)
    return document[0]["Plan"]


@pytest.fixture(scope="module")
def busy_table(django_db_setup: None, django_db_blocker: Any) -> Any:
    """20,000 jobs of each state a worker meets, and of a limited task, analysed: a plan that
    would read the table whole does so here, where the indexes cost far less."""
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            cursor.execute(
                """
                INSERT INTO pgjobs_job (id, queue, task, payload, status, priority, run_at,
                                        max_attempts, scheduled, finished_at, worker,
                                        leased_until, attempts, claims)
                SELECT gen_random_uuid(), 'default', 'tests.tasks.noop', '{}', s.status,
                       g % 3 - 1, now() + s.due * interval '1 minute', 3, s.due > 0,
                       CASE WHEN s.status = 'succeeded' THEN now() END,
                       CASE WHEN s.status = 'running' THEN 'w' || g % 8 END,
                       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
                       (s.status <> 'ready')::int, (s.status <> 'ready')::int
                FROM generate_series(1, 20000) AS g,
                     (VALUES ('ready', -60), ('ready', 60), ('succeeded', -60),
                             ('running', -60)) AS s(status, due)
                """
            )
            # And a limited task's, ready and running, over 10,000 limit keys.
            cursor.execute(
                """
                INSERT INTO pgjobs_job (id, queue, task, payload, status, priority, run_at,
                                        max_attempts, worker, leased_until, limit_key)
                SELECT gen_random_uuid(), 'default', 'tests.tasks.export', '{}', s.status, 0,
                       now() - interval '1 minute', 3,
                       CASE WHEN s.status = 'running' THEN 'w' || g % 8 END,
                       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
                       'c' || g % 10000
                FROM generate_series(1, 20000) AS g,
                     (VALUES ('ready'), ('running')) AS s(status)
                """
            )
            cursor.execute("ANALYZE pgjobs_job")
        yield
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE pgjobs_job CASCADE")


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_every_statements_generic_plan_reads_the_job_table_by_its_indexes(busy_table, name):
    plan = generic_plan(STATEMENTS[name], SAMPLES | SAMPLES_OF.get(name, {}))
    whole = [
        node for node in nodes(plan)
        if node.get("Relation Name") == "pgjobs_job" and node["Node Type"] == "Seq Scan"
    ]  # fmt: skip
    assert not whole, shown(plan)
