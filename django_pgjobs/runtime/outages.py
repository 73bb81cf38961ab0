"""What a worker says and does when the database cannot be used, or a turn of its loop fails for
another reason (a bug, ours or in the application's code it runs on that thread: a logging
filter, a model signal's receiver): retry with backoff, one line per attempt and the traceback
once; with --once, one clear line and a non-zero exit."""

from __future__ import annotations

import logging

from django.db import DatabaseError, InterfaceError, OperationalError

from django_pgjobs import schema
from django_pgjobs.data import rows
from django_pgjobs.errors import first_line
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.logs import quietly

logger = logging.getLogger(__name__)


class WorkerError(Exception):
    """The worker cannot run (with --once: the database is unreachable or not migrated)."""


class Outage:
    """Failures in a row of the statements of `who` (the worker's loop, or the relay)."""

    def __init__(self, who: str = "the worker loop", prefix: str = "") -> None:
        self.who, self.prefix = who, prefix  # prefix: the lines of another than the worker's
        self.failures = 0
        self.database = True  # whether the last failure was the database's

    def failed(self, error: Exception) -> float:
        """Log this failure; returns how long to wait before trying again."""
        self.failures += 1
        self.database = isinstance(error, DatabaseError)
        pause = policy.outage_pause(self.failures)
        if self.failures == 1:
            quietly(
                logger.error, "%s%s; retrying in %.2fs", self.prefix, self.describe(error), pause,
                exc_info=error,
            )  # fmt: skip
        else:
            quietly(
                logger.warning, "%s%s (attempt %d); retrying in %.1fs",
                self.prefix, self.describe(error), self.failures, pause,
            )  # fmt: skip
        return pause

    def over(self) -> None:
        if self.failures:
            what = "the database is back" if self.database else f"{self.who} runs again"
            quietly(logger.info, "%s%s after %d failed attempts", self.prefix, what, self.failures)
            self.failures = 0

    def describe(self, error: Exception) -> str:
        """One line saying what is wrong and, where we know, what to do."""
        first = first_line(error)
        if not isinstance(error, DatabaseError):
            return f"error in {self.who}: {type(error).__qualname__}: {first}"
        # An undefined table or column: the schema is older than the code.
        if schema.is_not_migrated(error):
            return schema.explained(error)
        if rows.plan_unfit(error):  # prepared: runtime/locks.py
            return (
                "a migration changed the job table under the worker's prepared statements; "
                "it reconnects, which prepares them again"
            )
        if "lock timeout" in first:
            return f"a statement waited too long for a lock held elsewhere ({first})"
        if rows.timed_out(error):  # a statement_timeout: QueryCanceled is an OperationalError
            return f"a statement ran out of time ({first})"
        if rows.rolled_back(error):  # the same: not the connection's fault
            return f"the database rolled a transaction back ({first})"
        if rows.refuses_writes(error):
            return (
                f"the database refuses writes ({first}): a standby, or read-only; after a "
                "failover the connection may have reached the old primary or a replica: "
                "connecting again"
            )
        if isinstance(error, OperationalError | InterfaceError):
            return f"cannot reach the database: {first}"
        return f"database error in {self.who}: {type(error).__name__}: {first}"
