"""Named records the data layer takes and returns, instead of positional tuples."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple
from uuid import UUID

if TYPE_CHECKING:
    from django_pgjobs.models import Job

# Text written on the failure path must never make that write fail: cleaned and bounded first.
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

    job: Job | Claim
    failure: Failure
    permanent: bool
    delay: float


#: A claim's key: the job's id and its claim count (the fencing token).
ClaimKey = tuple[UUID, int]


@dataclass(frozen=True, eq=False)
class Claim:
    """A worker's claim on one job: the job's id, its claim count (the fencing token) and the
    worker, beside the Job its handler gets. Guarded statements name the claim, so nothing a
    handler does to its Job (a refresh_from_db(), say) can change what they guard on."""

    job: Job
    id: UUID
    count: int
    worker: str | None

    @classmethod
    def of(cls, job: Job) -> Claim:
        """The claim `job`'s fields say it has now (for a Job just claimed: its claim)."""
        return cls(job, job.pk, job.claims, job.worker)

    @property
    def key(self) -> ClaimKey:
        return (self.id, self.count)


def as_claim(job_or_claim: Job | Claim) -> Claim:
    """A worker's Claim as it is; a Job as the claim its fields say it has."""
    return job_or_claim if isinstance(job_or_claim, Claim) else Claim.of(job_or_claim)


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
    recorded: dict[ClaimKey, str]
    #: Why the claimed rows could not be made Job objects: they were given back, `claimed` empty.
    unread: Exception | None = None
    #: The batches of the jobs that ended, when the caller follows them up (batches.py).
    batches: frozenset[UUID] = frozenset()


class TakenBack(NamedTuple):
    """What a reap or an abandon did: jobs returned to ready, and dead-lettered."""

    returned: int
    failed: int
    #: The jobs returned to ready (id, claims, task, attempts), awaiting their tasks' own backoffs.
    ready: tuple[tuple[UUID, int, str, int], ...] = ()


class Keyed(NamedTuple):
    """What a claim of limited tasks' jobs took (JobManager.claim_keyed)."""

    claimed: list[Job]
    #: Seconds until a key its rate held back may start a job again; None: none was held back.
    wait: float | None
    #: The last key it looked at: the next claim's keys start after it.
    cursor: tuple[str, str]
    #: How many keys with room it found (None: it did not look).
    keys: int | None = None
    #: It looked at as many keys as one claim may: more may wait beyond them.
    more: bool = False


class Position(NamedTuple):
    """Where a worker's claims in one queue got to: the claim order's key of the last job it
    claimed there, after which its next claim there starts."""

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
    limit_key: str | None = None  # its task's limits are held per this value (limits.py)
