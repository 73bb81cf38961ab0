"""Flow control: what `@task(rate_limit=..., concurrency_limit=..., limit_by=...)` and
`Queue.rate_limit` mean, checked when they are given (docs/explanation/flow-control.md).

A limited task's job carries its *limit key* (`Job.limit_key`): the value of its `limit_by`
argument, or "" when the limits are the whole task's. The worker claims such jobs apart
(data/sql.py, CLAIM_KEYED), a key at a time, so that every key takes its turn and one at its
limit holds back no other.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, Protocol

from django.core.exceptions import ValidationError

from django_pgjobs.errors import EnqueueError

#: The seconds of a rate a limit may start at once (at least one job): "20/s" starts 4 at
#: once, then one every 50 ms. Without it every start would cost a claim of its own.
BURST_SECONDS = 0.2
#: The longest limit key: a key is part of an index entry.
MAX_KEY_LENGTH = 200
#: The most a limit may say (starts per unit, or jobs at once): more is no limit, and past
#: PostgreSQL's integers it would fail every claim.
MOST = 1_000_000

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*([smh])\s*")

LimitBy = str | Callable[[Mapping[str, Any]], str]


class Limited(Protocol):
    """What the rules read of a task (registry.Task)."""

    @property
    def name(self) -> str: ...
    @property
    def rate_limit(self) -> Rate | None: ...
    @property
    def concurrency_limit(self) -> int | None: ...
    @property
    def limit_by(self) -> LimitBy | None: ...
    @property
    def limited(self) -> bool: ...


@dataclass(frozen=True)
class Rate:
    """At most `count` starts per `per` seconds, held by all workers together."""

    count: int
    per: float

    @property
    def interval(self) -> float:
        """Seconds between two starts at the full rate."""
        return self.per / self.count

    @property
    def burst(self) -> int:
        """Starts a full bucket allows at once."""
        return max(1, math.floor(BURST_SECONDS / self.interval + 1e-9))

    def starts(self, full_at: datetime | None, now: datetime) -> int:
        """How many starts its bucket holds at `now`, full at `full_at` (None: full)."""
        if full_at is None or full_at <= now:
            return self.burst
        spent = math.ceil((full_at - now).total_seconds() / self.interval - 1e-9)
        return max(0, self.burst - spent)

    @property
    def emptiest_in(self) -> float:
        """The longest a bucket takes to fill at this rate (seconds): all its burst spent."""
        return self.burst * self.interval

    def emptiest(self, now: datetime) -> datetime:
        """The latest a bucket may be full again at this rate, at `now`."""
        return now + timedelta(seconds=self.emptiest_in)

    def __str__(self) -> str:
        unit = next(u for u, seconds in _UNITS.items() if seconds == self.per)
        return f"{self.count}/{unit}"


def describe(task: Limited) -> str:
    """A task's limits in a few words: "20/s, 2 at once, per customer_id"."""
    said = []
    if task.rate_limit is not None:
        said.append(str(task.rate_limit))
    if task.concurrency_limit is not None:
        said.append(f"{task.concurrency_limit} at once")
    by = task.limit_by
    if by is not None:
        name = by if isinstance(by, str) else getattr(by, "__name__", "<lambda>")
        said.append(f"per {'key' if name == '<lambda>' else name}")
        if len(said) == 1:
            said[0] = f"turns {said[0]}"
    return ", ".join(said)


def parse_rate(text: object, where: str) -> Rate:
    """The Rate `text` ("10/s", "100/m", "1000/h") says; ValueError naming `where` if none."""
    match = _RATE.fullmatch(text) if isinstance(text, str) else None
    if match is None or not 1 <= int(match[1]) <= MOST:
        raise ValueError(
            f"{where}: {text!r} is not a rate; write a whole number of starts from 1 to "
            f'{MOST:,} per second, minute or hour, as "10/s", "100/m" or "1000/h".'
        )
    return Rate(int(match[1]), _UNITS[match[2]])


def rate_or_none(text: str | None) -> Rate | None:
    """A stored rate limit (Queue.rate_limit), None if empty or unreadable: a row written by
    other means than the form must not stop its queue's claims."""
    try:
        return None if not text else parse_rate(text, "rate limit")
    except ValueError:
        return None


def validate_rate(text: str) -> None:
    """Queue.rate_limit's form validator."""
    try:
        parse_rate(text, "rate limit")
    except ValueError as error:
        raise ValidationError(str(error)) from None


def check_concurrency(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        raise ValueError(
            f"@task(concurrency_limit={value!r}) must be a whole number of jobs from 1 to "
            f"{MOST:,} (None: no limit)."
        )
    return value


def check_limit_by(value: object, func: Callable[..., Any]) -> LimitBy:
    if callable(value):
        return value
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(
            f"@task(limit_by={value!r}) must name one of the task's keyword arguments (as "
            '"customer_id"), or be a function of the payload that returns a string.'
        )
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a callable Python cannot read: the enqueue checks
        return value
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if value not in parameters and not takes_any:
        raise ValueError(
            f"@task(limit_by={value!r}): {func.__name__}() takes no argument {value!r} "
            f"(it takes {', '.join(parameters) or 'none'}): name one it takes."
        )
    return value


def key_of(task: Limited, payload: Mapping[str, Any]) -> str | None:
    """The limit key of a job of `task` with `payload`: None when the task has no limits, ""
    when they are the whole task's, else the value of its `limit_by`; EnqueueError if the
    payload gives none."""
    by = task.limit_by
    if by is None:
        return "" if task.limited else None
    if callable(by):
        try:
            value = by(payload)
        except Exception as error:
            raise EnqueueError(
                f"task {task.name!r}: its limit_by function raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(value, str):
            raise EnqueueError(
                f"task {task.name!r}: its limit_by function returned {value!r}; it must return "
                "a string (the key the task's limits are held per)."
            )
    else:
        if by not in payload:
            raise EnqueueError(
                f"task {task.name!r} is limited by {by!r}, which this payload lacks: pass "
                f"{by}=... (its limits are held per value of it)."
            )
        value = payload[by]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise EnqueueError(
                f"task {task.name!r} is limited by {by!r}, whose value here is {value!r}: a "
                "key must be a string or a whole number."
            )
        value = str(value)
    if "\x00" in value or _unencodable(value):
        raise EnqueueError(
            f"task {task.name!r}: its limit key {value[:40]!r} holds a NUL or a lone surrogate, "
            "which PostgreSQL's text cannot store."
        )
    if len(value) > MAX_KEY_LENGTH:
        raise EnqueueError(
            f"task {task.name!r}: its limit key {value[:40]!r}... is {len(value)} characters "
            f"long; {MAX_KEY_LENGTH} at most."
        )
    return value


def _unencodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


#: The advisory locks' first key: a limit key's lock is (LOCK_CLASS, hash of task and key), apart
#: from the application's one-key locks and from two-key locks of other classes.
LOCK_CLASS = 0x706A6C  # "pjl"


@dataclass(frozen=True)
class TaskLimits:
    """The limits of the registered tasks that have any, as data/sql.py's CLAIM_KEYED takes
    them; a task missing here (its limits dropped since its jobs were enqueued) has none."""

    tasks: tuple[str, ...] = ()
    concurrency: tuple[int | None, ...] = ()
    every: tuple[float | None, ...] = ()
    burst: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, tasks: Mapping[str, Limited]) -> TaskLimits:
        limited = [task for task in tasks.values() if task.limited]
        rates = [task.rate_limit for task in limited]
        return cls(
            tuple(task.name for task in limited),
            tuple(task.concurrency_limit for task in limited),
            tuple(None if rate is None else rate.interval for rate in rates),
            tuple(None if rate is None else rate.burst for rate in rates),
        )

    @cached_property  # asked every turn
    def counted(self) -> frozenset[str]:
        """The tasks with a concurrency limit: a job of theirs that ends frees a slot."""
        most = zip(self.tasks, self.concurrency, strict=True)
        return frozenset(task for task, limit in most if limit is not None)

    @cached_property  # asked every claim
    def locking(self) -> list[str]:
        """The tasks whose keys are claimed from by one worker at a time: those with a limit
        (a task with only limit_by takes turns between keys, and nothing to count)."""
        return [
            task
            for task, most, every in zip(self.tasks, self.concurrency, self.every, strict=True)
            if most is not None or every is not None
        ]
