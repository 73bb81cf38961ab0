"""A worker's chores (runtime/chores.py): when its reaper holds back, after what may have held
up every worker's heartbeats."""

from __future__ import annotations

import psycopg
import pytest
from django.db import OperationalError

from django_pgjobs.runtime.chores import Reaper


def _database_error(cause: Exception) -> Exception:
    error = OperationalError(str(cause))
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("cause", "held"),
    [
        (psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"), True),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), True),
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg.errors.SerializationFailure("could not serialize access"), False),
        (psycopg.errors.DeadlockDetected("deadlock detected"), False),
    ],
    ids=["lock timeout", "statement timeout", "connection lost", "serialization", "deadlock"],
)
def test_a_reaper_holds_back_after_what_may_have_held_up_every_heartbeat_only(cause, held):
    # A serialization failure comes and goes under contention (a database whose default
    # isolation is serializable): were it trouble, a worker that met one every few seconds
    # would never take back a dead worker's jobs.
    reaper = Reaper(None, 5.0, lambda: None, list)  # type: ignore[arg-type]
    reaper.trouble(_database_error(cause))
    assert reaper._troubled is held
    reaper.trouble(ValueError("a bug"))
    assert reaper._troubled is held
