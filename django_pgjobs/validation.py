"""Checks on enqueue's input, each raising a specific EnqueueError before anything is written."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from django_pgjobs.delays import as_seconds
from django_pgjobs.errors import EnqueueError

MIN_PRIORITY, MAX_PRIORITY = -100, 100
#: The most attempts a job may have: its column is an int4.
MAX_ATTEMPTS = 2**31 - 1
#: The longest lease or time limit, in seconds (about 31 years): far longer overflows
#: PostgreSQL's intervals, failing the heartbeat for every job of the worker.
MAX_SECONDS = 1e9
#: The longest task name: the job's `task` column.
MAX_TASK_NAME = 200
#: The earliest and latest run_at: the years 1 to 9999 with a day's margin at each end, so that
#: the time loads in Python whatever time zone a connection reads it in.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
LATEST = datetime(9999, 12, 30, tzinfo=UTC)
#: How deeply lists and objects may nest in a payload (or a kept result).
MAX_DEPTH = 64
#: The largest integer a payload may hold, in bits (Python prints at most 4,300 digits).
MAX_INT_BITS = 14_000
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def check_queue(queue: Any) -> str:
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise EnqueueError(
            f"queue={queue!r} is not a valid queue name: use 1 to 100 letters, digits, '_', '.', "
            "':' or '-', starting with a letter or digit."
        )
    return queue


def check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise EnqueueError(f"priority={priority!r} must be an integer.")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise EnqueueError(
            f"priority={priority} is out of range: use {MIN_PRIORITY}..{MAX_PRIORITY} "
            "(higher runs first)."
        )
    return priority


def check_max_attempts(max_attempts: Any) -> int:
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        raise EnqueueError(
            f"max_attempts={max_attempts!r} must be an integer from 1 to {MAX_ATTEMPTS}."
        )
    return max_attempts


def check_task_name(name: str) -> str:
    if len(name) > MAX_TASK_NAME:
        raise EnqueueError(
            f"the task name {name[:60]!r}... is {len(name)} characters long; a job's task "
            f"holds at most {MAX_TASK_NAME}: register the task under a shorter name "
            "(@task(name=...))."
        )
    return name


def check_run_at(run_at: Any) -> datetime:
    if not isinstance(run_at, datetime):
        raise EnqueueError(f"run_at={run_at!r} must be a timezone-aware datetime.")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise EnqueueError(
            f"run_at={run_at!r} is a naive datetime; pass an aware one "
            "(django.utils.timezone.now() + ..., or datetime(..., tzinfo=...))."
        )
    try:
        in_range = EARLIEST <= run_at.astimezone(UTC) <= LATEST
    except OverflowError:
        in_range = False
    if not in_range:
        # Stored, it would be a time Python cannot load again, in some time zone at least.
        raise EnqueueError(
            f"run_at={run_at!r} is out of range: it must fall between {EARLIEST.isoformat()} "
            f"and {LATEST.isoformat()}."
        )
    return run_at


def check_delay(delay: Any) -> float:
    try:
        return as_seconds(delay, "delay")
    except ValueError as error:
        raise EnqueueError(f"{error} Use run_at for a fixed time.") from None


def check_unique_key(unique_key: Any) -> str:
    if not isinstance(unique_key, str) or not 1 <= len(unique_key) <= 200:
        raise EnqueueError(f"unique_key={unique_key!r} must be a string of 1 to 200 characters.")
    _check_text(unique_key, "unique_key")
    return unique_key


def payload_json(payload: Any, max_bytes: int) -> str:
    """The payload as JSON text, after checking that it survives a round trip through jsonb."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise EnqueueError(
            "payload must be a JSON object (a dict of keyword arguments), "
            f"got {type(payload).__name__}."
        )
    return json_text(payload, "payload", max_bytes, "Store large data elsewhere and pass its id.")


def json_text(value: Any, what: str, max_bytes: int, too_big: str) -> str:
    """`value` as compact JSON text, once it is known to survive a round trip through jsonb
    and to be at most `max_bytes`; EnqueueError naming `what` (and, when too big, saying
    `too_big`) otherwise."""
    # One quick walk and one encoding; the walk that names a problem's path only when needed.
    if not _plain(value, 0):
        _check_value(value, what)  # raises, unless only a subclass (of str, dict, ...) was seen
    try:
        text = _ENCODER.encode(value)
        size = len(text.encode())
    except ValueError:  # NaN or Infinity, or a lone surrogate (UnicodeEncodeError)
        _check_value(value, what)
        raise
    if "\\u0000" in text:  # a NUL character, or those six characters in a string
        _check_value(value, what)
    if size > max_bytes:
        raise EnqueueError(
            f"{what} is {size:,} bytes of JSON, over the limit of {max_bytes:,} "
            f"(PGJOBS['MAX_PAYLOAD_BYTES']). {too_big}"
        )
    return text


def _plain(value: Any, depth: int) -> bool:
    """The fast path of _check_value: only dicts with str keys, lists, str, int of at most
    MAX_INT_BITS, float, bool and None, nested at most MAX_DEPTH deep (the JSON text's checks
    cover the rest)."""
    kind = type(value)
    if kind is dict:
        return depth <= MAX_DEPTH and all(
            type(key) is str and _plain(item, depth + 1) for key, item in value.items()
        )
    if kind is list:
        return depth <= MAX_DEPTH and all(_plain(item, depth + 1) for item in value)
    if kind is int:
        return value.bit_length() <= MAX_INT_BITS  # type: ignore[no-any-return]
    return kind is str or kind is float or kind is bool or value is None


def jsonable(value: Any) -> Any:
    """`value` as it reads back from jsonb: tuples as lists and UTF-8 bytes as text (as Django's
    Tasks framework normalises arguments); anything else is left to the JSON checks."""
    if isinstance(value, tuple | list):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


def _check_value(value: Any, path: str, depth: int = 0) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise EnqueueError(
                f"{path} is an integer of {value.bit_length():,} bits; JSON texts hold integers "
                f"of at most {MAX_INT_BITS:,} bits here. Pass a large number as a string."
            )
        return
    if depth > MAX_DEPTH and isinstance(value, dict | list):
        raise EnqueueError(
            f"{path} nests lists and objects more than {MAX_DEPTH} levels deep; flatten it "
            "(PostgreSQL and the worker's JSON parser limit nesting)."
        )
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise EnqueueError(f"{path} is {value!r}, which JSON cannot represent.")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise EnqueueError(
                    f"{path} has the key {key!r} ({type(key).__name__}); JSON object keys "
                    "must be strings."
                )
            _check_text(key, f"{path} key {key!r}")
            _check_value(item, f"{path}[{key!r}]", depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_value(item, f"{path}[{index}]", depth + 1)
    else:
        raise EnqueueError(
            f"{path} is a {type(value).__name__}, which does not survive JSON: pass "
            "str, int, float, bool, None, list or dict (e.g. an ISO string for a datetime, "
            "a list for a tuple or set, a primary key for a model instance)."
        )


def _check_text(text: str, path: str) -> None:
    if "\x00" in text:
        raise EnqueueError(f"{path} contains a NUL character (\\u0000), which jsonb cannot store.")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise EnqueueError(
            f"{path} contains a lone surrogate, which is not valid Unicode text."
        ) from None
