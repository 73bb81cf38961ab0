"""Logging filters as applications write them, for the crash tests."""

from __future__ import annotations

import logging


class RequestUser(logging.Filter):
    """Adds the request's user to a record: written for django.request's records, it raises
    AttributeError on any other (a worker's among them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.user = record.request.user  # type: ignore[attr-defined]
        return True
