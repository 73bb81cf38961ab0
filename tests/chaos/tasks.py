"""The chaos suite's tasks. Each execution writes one ledger row over its own connection."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from django.db import connections

from django_pgjobs import current_job, task
from django_pgjobs.retry import ExponentialBackoff
from tests.conftest import connection_kwargs

_local = threading.local()

# How long a handler keeps trying to write its ledger row while the database is away (a restart,
# a terminated connection) before it gives up and lets the attempt fail.
LEDGER_PATIENCE = 60.0


def _ledger_connection() -> psycopg.Connection[Any]:
    connection: psycopg.Connection[Any] | None = getattr(_local, "connection", None)
    if connection is None or connection.closed:
        name = connections["default"].settings_dict["OPTIONS"].get("application_name")
        connection = psycopg.connect(
            **connection_kwargs(),
            **({"application_name": name} if name else {}),
            autocommit=True,
            prepare_threshold=None,  # PgBouncer in transaction pooling mode
            connect_timeout=5,
        )
        _local.connection = connection
    return connection


def record(ok: bool) -> None:
    """Write this execution's ledger row (job, attempt, worker), retrying across reconnects.

    Idempotent per attempt: a write whose acknowledgement was lost is not counted twice.
    """
    job = current_job()
    assert job is not None
    deadline = time.monotonic() + LEDGER_PATIENCE
    while True:
        try:
            _ledger_connection().execute(
                "INSERT INTO chaos_execution (job_id, attempt, worker, pid, ok, at) "
                "VALUES (%s, %s, %s, %s, %s, clock_timestamp()) "
                "ON CONFLICT (job_id, attempt, worker) DO NOTHING",
                [job.pk, job.attempts, job.worker, os.getpid(), ok],
            )
            return
        except psycopg.OperationalError:
            connection = getattr(_local, "connection", None)
            if connection is not None:
                connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@task(name="chaos.work", max_attempts=25)
def work(n: int, seconds: float = 0.0) -> None:
    """Take `seconds`, then record the execution: the effect that must happen at least once."""
    if seconds:
        time.sleep(seconds)
    record(ok=True)


@task(name="chaos.poison", max_attempts=3)
def poison(n: int) -> None:
    """Kill the worker process that runs it, every time."""
    record(ok=False)
    os._exit(17)


class DependencyDown(ConnectionError):
    pass


STORM_BACKOFF = ExponentialBackoff(base=0.5, cap=4.0)


@task(name="chaos.flaky", max_attempts=40, backoff=STORM_BACKOFF)
def flaky(n: int, recovers_at: float) -> None:
    """Fail while a dependency is down (until the wall-clock time `recovers_at`), then succeed."""
    if time.time() < recovers_at:
        record(ok=False)
        raise DependencyDown("dependency unavailable")
    record(ok=True)


# ---- batches (test_batches_under_kills.py) -------------------------------------------------------


@task(name="chaos.member", queue="batches", max_attempts=3, backoff=lambda attempt: 0)
def member(n: int, dies: bool = False, seconds: float = 0.0) -> int:
    """A batch's member: takes `seconds`. One that `dies` fails every attempt (a dead letter
    after its third) until it is replayed: then it succeeds."""
    if seconds:
        time.sleep(seconds)
    job = current_job()
    assert job is not None
    if dies and not any("replayed_at" in entry for entry in job.errors):
        raise RuntimeError(f"member {n} dies")
    return n
