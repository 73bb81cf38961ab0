"""Named records the data layer takes and returns, instead of positional tuples."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple
from uuid import UUID

if TYPE_CHECKING:
    from django_pgjobs.models import Job

# Text written on the failure path must never make that write fail (a NUL byte in an error
# message once left jobs stuck in other queues), so it is cleaned and bounded first.
MESSAGE_LIMIT = 2000
TRACEBACK_LIMIT = 4000


def clean_text(text: str, limit: int, keep: str = "head") -> str:
    """Text PostgreSQL will accept: no NUL bytes, no lone surrogates, at most `limit` characters."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep == "tail" else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Failure:
    """What a failed attempt leaves in the job's error history."""

    type: str
    message: str
    traceback: str = ""

    def as_json(self) -> str:
        return json.dumps(
            {
                "type": clean_text(self.type, 200),
                "message": clean_text(self.message, MESSAGE_LIMIT),
                "traceback": clean_text(self.traceback, TRACEBACK_LIMIT, keep="tail"),
            }
        )

    @property
    def summary(self) -> str:
        return clean_text(
            f"{self.type}: {self.message}" if self.message else self.type, MESSAGE_LIMIT
        )


class FailedAttempt(NamedTuple):
    """A failed attempt to record: back to ready after `delay` seconds while attempts remain
    and the error is not `permanent`, else failed (the dead letter)."""

    job: Job
    failure: Failure
    permanent: bool
    delay: float


#: A claim: the job's id and its claim count (the fencing token).
Claim = tuple[UUID, int]


#: Where `hold` keeps a claimed job's claim (an attribute no model field uses).
_HELD = "_pgjobs_held"


def hold(job: Job) -> None:
    """Keep `job`'s claim as the worker claimed it: its id, its claim count and the worker.
    The handler gets this same object (current_job()); what it does to its fields (a
    refresh_from_db() after its lease was lost and another worker claimed the job, say) must
    not change the claim the worker's guarded statements name."""
    job.__dict__[_HELD] = (job.pk, job.claims, job.worker)


def claimed(job: Job) -> bool:
    """Whether a worker holds `job` as claimed (see `hold`): its handler's Job."""
    return _HELD in job.__dict__


def claim_of(job: Job) -> Claim:
    """The claim the worker holds on `job` (see `hold`): its id and claim count."""
    held = job.__dict__.get(_HELD)
    return (held[0], held[1]) if held else (job.pk, job.claims)


def holder_of(job: Job) -> str | None:
    """The worker that claimed `job` (see `hold`)."""
    held = job.__dict__.get(_HELD)
    return held[2] if held else job.worker


class Settled(NamedTuple):
    """What one turn's statement recorded and claimed (JobManager.settle_and_claim)."""

    #: Ids of the completed jobs this worker still owned.
    succeeded: set[UUID]
    #: The new status of each failed job this worker still owned.
    failed: dict[UUID, str]
    #: The jobs claimed, in claim order.
    claimed: list[Job]
    #: The new status of every outcome recorded, by claim: precise even when a worker held a
    #: stale and a fresh claim of one job.
    recorded: dict[Claim, str]
    #: What made the claimed rows impossible to turn into Job objects (a model signal's
    #: receiver raised, say): they were given back, and `claimed` is empty.
    unread: Exception | None = None


class TakenBack(NamedTuple):
    """What a reap or an abandon did: jobs returned to ready, and dead-lettered."""

    returned: int
    failed: int
    #: The jobs returned to ready (id, claim count, task, attempts), due after the default
    #: backoff until JobManager.delay sets their task's own.
    ready: tuple[tuple[UUID, int, str, int], ...] = ()


class Position(NamedTuple):
    """Where a worker's claims in one queue got to: the claim order's key (priority, run_at,
    id) of the last job it claimed there. Its next claim there starts after it (see
    sql.SETTLE_AND_CLAIM's `due`)."""

    priority: int
    run_at: datetime
    id: UUID

    @classmethod
    def of(cls, job: Job) -> Position:
        return cls(job.priority, job.run_at, job.pk)


class NewJob(NamedTuple):
    """One job to insert, its options checked (see data.enqueue.options_of)."""

    id: UUID
    queue: str
    task: str
    payload_json: str
    priority: int
    run_at: datetime | None  # None: now + delay, on the database's clock
    delay: float | None
    max_attempts: int
    unique_key: str | None
