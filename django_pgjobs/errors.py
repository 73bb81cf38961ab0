"""Exceptions users raise from handlers, and the ones enqueue raises on bad input."""

from __future__ import annotations

from datetime import timedelta

from django.db import ProgrammingError

from django_pgjobs.delays import as_seconds


def text_of(error: BaseException) -> str:
    """str(error), or a line naming its type when that raises (any exception from a handler or
    a task's backoff must be describable without raising again)."""
    try:
        return str(error)
    except BaseException as broken:
        return f"<{type(error).__qualname__} that could not be shown: {type(broken).__qualname__}>"


def first_line(error: BaseException) -> str:
    """The first line of `error`'s text (a database error's detail and hint follow on lines of
    their own), or its type's name when it has none."""
    return (text_of(error).strip().splitlines() or [type(error).__name__])[0]


class PermanentError(Exception):
    """Raise from a handler to fail the job at once, with no further attempts."""


class Retry(Exception):
    """Raise from a handler to run the job again later without counting it as an error.

    ``delay`` is seconds or a ``timedelta``.
    """

    def __init__(self, delay: float | timedelta = 0) -> None:
        seconds = as_seconds(delay, "Retry(delay=...)")
        super().__init__(f"retry in {seconds:g}s")
        self.delay = seconds


class EnqueueError(ValueError):
    """Bad input to enqueue; raised before anything is written."""


class UnknownTask(EnqueueError, LookupError):
    """The task name is not in the registry."""


class PayloadMismatch(TypeError):
    """The payload's keys do not fit the handler's signature (a permanent error)."""


class NotMigrated(ProgrammingError):
    """A pgjobs table or column does not exist: run ``manage.py migrate``. Raised by enqueue,
    a database error all the same (Django's ProgrammingError); the admin, ``jobstats`` and
    ``runjobs`` say the same in their own way."""


class JobCancelled(PermanentError):
    """Raise from a handler that noticed ``cancel_requested()``: the job ends as cancelled."""


class JobTimeout(Exception):
    """An attempt ran past its time limit (``@task(timeout=...)`` or PGJOBS["TIMEOUT"])."""
