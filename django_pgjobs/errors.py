"""Exceptions users raise from handlers, and the ones enqueue raises on bad input."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Never

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
    """Raise from a handler to run the job again after ``delay`` (seconds or a ``timedelta``),
    without counting it as an error."""

    # **celery: Celery's self.retry() options, refused saying what to write instead.
    def __init__(self, delay: float | timedelta = 0, **celery: Never) -> None:
        if celery:
            raise celery_spelling("Retry", celery, _RETRY_OPTIONS)
        seconds = as_seconds(delay, "Retry(delay=...)")
        super().__init__(f"retry in {seconds:g}s")
        self.delay = seconds


#: Celery's options of self.retry(), and what to write instead.
_RETRY_OPTIONS = {
    "countdown": "pass Retry(delay=...): seconds, or a timedelta",
    "eta": "pass Retry(delay=...), the time until then: seconds, or a timedelta",
    "exc": (
        "to retry after an error, re-raise the error (the attempt counts, and the task's "
        "backoff decides when); Retry(delay=...) is for not yet, and counts no attempt"
    ),
}


def celery_spelling(
    call: str, given: Mapping[str, object], spellings: Mapping[str, str]
) -> TypeError:
    """The TypeError for keyword arguments `call` does not take: for Celery's names (keys of
    `spellings`), what to write instead; for others, Python's own words."""
    said = [
        f"{call}({name}={_shown(value)}) is Celery's: {spellings[name]}."
        for name, value in given.items()
        if name in spellings
    ]
    others = [name for name in given if name not in spellings]
    if others:
        said.append(f"{call}() got an unexpected keyword argument {others[0]!r}.")
    return TypeError(" ".join(said))


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # the caller's object: its repr is not ours to trust
        return "..."
    return text if len(text) <= 40 else "..."


class EnqueueError(ValueError):
    """Bad input to enqueue; raised before anything is written."""


class NotJSONSerializable(EnqueueError, TypeError):
    """A value of a type JSON does not have (a datetime, a set, a model instance): an
    EnqueueError, and the TypeError that Django's Tasks framework raises for it."""


class CelerySpelling(AttributeError):
    """A Celery attribute asked of a task (``delay``, ``apply_async``, ``s``): an AttributeError
    (so ``hasattr`` says False) that says what to write instead."""


class UnknownTask(EnqueueError, LookupError):
    """The task name is not in the registry."""


class PayloadMismatch(TypeError):
    """The payload's keys do not fit the handler's signature (a permanent error)."""


class NotMigrated(ProgrammingError):
    """A pgjobs table or column does not exist: run ``manage.py migrate``. Raised by enqueue,
    a ProgrammingError all the same."""


class JobCancelled(PermanentError):
    """Raise from a handler that noticed ``cancel_requested()``: the job ends as cancelled."""


class JobTimeout(Exception):
    """An attempt ran past its time limit (``@task(timeout=...)`` or PGJOBS["TIMEOUT"])."""
