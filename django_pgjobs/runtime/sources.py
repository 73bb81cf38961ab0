"""The seam between the worker loop and where its jobs come from: a `Source` (PostgreSQL, or a
NATS JetStream stream), what the two share (`Seat`, `Claims`), what one exchange did
(`Exchange`, `Recorded`), and the buffer of outcomes waiting to be kept (`Finished`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from django_pgjobs.data.records import Claim
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.reporting import Announcer


class Recorded(NamedTuple):
    """An attempt whose outcome a source kept (or found it could not: Outcome.LOST)."""

    job: Job
    handled: Handled
    outcome: Outcome
    #: Whether the source said it in the log already (log_outcome then says nothing).
    logged: bool = False


@dataclass
class Exchange:
    """What one exchange with a source did, filled in as it goes: what is in it counts even
    when the exchange then raised."""

    recorded: list[Recorded] = field(default_factory=list)
    claimed: list[Job] = field(default_factory=list)
    #: When (time.monotonic()) to claim again at the latest, whatever the poll schedule says.
    poll_by: float = float("inf")
    #: A limit's rate held due jobs back: they are claimed at poll_by (a --once worker is not
    #: drained yet).
    held: bool = False


class Claims:
    """The claims a worker holds: taken and not yet recorded, each kept as it was claimed
    (Claim), by the Job its handler gets (never by job id: a stale claim's outcome must not
    forget a newer claim of the same job). Shared with the threads that renew leases."""

    def __init__(self) -> None:
        self._kept: dict[int, Claim] = {}
        self._lock = threading.Lock()

    def add(self, jobs: Sequence[Job]) -> None:
        """Keep the claims of jobs just taken (their fields are the claims' now)."""
        with self._lock:
            for job in jobs:
                self._kept[id(job)] = Claim.of(job)

    def forget(self, jobs: Sequence[Job]) -> None:
        with self._lock:
            for job in jobs:
                self._kept.pop(id(job), None)

    def of(self, job: Job) -> Claim:
        """The claim kept for `job` (a Job it never took: the claim its fields say)."""
        return self._kept.get(id(job)) or Claim.of(job)

    def all(self) -> list[Claim]:
        with self._lock:
            return list(self._kept.values())

    def __contains__(self, job: Job) -> bool:
        return id(job) in self._kept

    def __len__(self) -> int:
        return len(self._kept)


@dataclass(frozen=True)
class Seat:
    """What a worker shares with its source: who it is, what it holds, and how to wake it."""

    id: str
    db: str
    lease: float
    options: Options
    controls: QueueControls
    claims: Claims
    #: The worker's signals (job_enqueued for what it enqueues itself: periodic ticks).
    announcer: Announcer
    #: Claim at the next turn (a notification came, expired jobs were reaped).
    poll_now: Callable[[], None]
    stopping: Callable[[], bool]
    #: When (time.monotonic()) the stop's grace ends (infinite until it stops).
    deadline: Callable[[], float]


class Source(Protocol):
    """Where a worker's jobs come from and where their outcomes go. Its methods run on the
    worker's main thread; threads of its own (lease renewal, acknowledgements) start in
    `start` and end by `shutdown`."""

    #: Its housekeeping, run by the worker's loop between turns (made by `attach`).
    chores: list[Chore]
    #: What the worker's first line calls its queues ("queues", "NATS queues").
    queues_are: str
    #: Whether its claims load the job database, so that its queues yield to the application.
    yields: bool

    def attach(self, seat: Seat) -> None:
        """Serve the worker at `seat` (once, when the worker is made)."""
        ...

    def start(self) -> None:
        """The worker runs: start the source's threads."""
        ...

    def can_claim(self) -> bool:
        """False while claims would be lost (the leases cannot be renewed)."""
        ...

    def exchange(
        self, finished: list[tuple[Job, Handled]], wanted: int, wait: float, turn: Exchange
    ) -> None:
        """Keep the `finished` attempts' outcomes and take up to `wanted` jobs, waiting at most
        `wait` seconds for them where the source waits for jobs itself. Removes from `finished`
        what it took charge of (the rest is handed in again); fills in `turn`."""
        ...

    def renew(self, jobs: list[Job]) -> None:
        """Extend these claims' leases now (their tasks have a longer lease than the worker)."""
        ...

    def give_back(self, jobs: list[Job]) -> None:
        """Return jobs taken and never started, without spending an attempt; raises (nothing
        returned) when it cannot."""
        ...

    def due_in(self) -> float:
        """Seconds until the source wants a turn of its own (0: now; inf: never)."""
        ...

    def failed(self, error: Exception) -> None:
        """A turn of the worker's failed with `error` (logged already)."""
        ...

    def shutdown(self, left: list[Claim]) -> tuple[list[Recorded], bool]:
        """The worker stops: return `left` (claims neither finished nor recorded) as the source
        does, end its threads; what it recorded meanwhile, and whether every claim was
        returned or recorded."""
        ...

    def close(self) -> None:
        """Close what the source opened (after the worker's last report)."""
        ...


class Finished:
    """Outcomes handed in by the handler threads, waiting for the main thread to keep them:
    a buffer, released in batches when policy.settle_due says so."""

    def __init__(self, options: Options, held: Callable[[], int], stopping: Callable[[], bool]):
        self.options, self._blocked, self._stopping = options, held, stopping
        self._done: list[tuple[Job, Handled]] = []
        self._first_at = 0.0  # when the oldest outcome came in
        self._lock = threading.Lock()

    def hand_in(self, job: Job, handled: Handled) -> bool:
        """Add an outcome (from a handler thread). True when the main thread should wake: for
        the first outcome (it then waits at most SETTLE_DELAY for others) and once they are
        due, not for every one."""
        with self._lock:
            first = not self._done
            if first:
                self._first_at = time.monotonic()
            self._done.append((job, handled))
            return first or self._due()

    def take(self) -> list[tuple[Job, Handled]] | None:
        """The outcomes, when they are due; None before (the turn then waits for them)."""
        with self._lock:
            if not self._due():
                return None
            done, self._done = self._done, []
            return done

    def put_back(self, done: list[tuple[Job, Handled]]) -> None:
        with self._lock:
            if done and not self._done:
                self._first_at = time.monotonic()
            self._done[:0] = done

    def __len__(self) -> int:
        return len(self._done)

    def due_in(self) -> float:
        with self._lock:
            if not self._done:
                return float("inf")
            return self._first_at + policy.SETTLE_DELAY - time.monotonic()

    def _due(self) -> bool:
        options = self.options
        return self._stopping() or policy.settle_due(
            len(self._done), self._blocked(), options.concurrency, options.batch_size,
            time.monotonic() - self._first_at,
        )  # fmt: skip
