"""Logging filters as applications write them, for the crash tests."""

from __future__ import annotations

import logging


class RequestUser(logging.Filter):
    """Adds the request's user to a record: written for django.request's records, it raises
    AttributeError on any other (a worker's among them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.user = record.request.user  # type: ignore[attr-defined]
        return True


class Exits(logging.Filter):
    """A filter that calls sys.exit (an application's "stop if logging is misconfigured" guard,
    say): SystemExit is not an Exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        raise SystemExit(f"logging refused {record.name}")
