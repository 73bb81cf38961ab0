"""Batches and dependencies: "run this when those are done", exactly once.

``with batch(on_complete=..., on_success=..., **payload) as b:`` makes the jobs enqueued in its
block members of batch `b`, written in the caller's transaction with them. ``after=[...]`` makes
a job wait (status ``waiting``) until the jobs and batches it names have succeeded.

No member's settle writes the batch's row (a row every settle updates would serialise the
workers on it). Instead, whatever ends jobs follows them up *after its commit* (`follow_up`): of
two sessions ending a batch's last two members at once, the later one sees both ended. The batch
moves (completes, succeeds) in one statement that inserts its callbacks and is guarded on the
batch's row, so each callback is enqueued once whoever follows up and however often. A follow-up
lost with its session (killed after its commit) is done by any worker's `sweep`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.apps import apps
from django.db import transaction

from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows, sql, wakeups
from django_pgjobs.errors import EnqueueError
from django_pgjobs.transports import POSTGRES, transport_of

if TYPE_CHECKING:
    from django_pgjobs.models import Batch

#: The most batches, and dependencies, one sweep looks at.
SWEEP_LIMIT = 500


#: The batch whose block is running here (the innermost): the jobs enqueued here join it.
_current: ContextVar[Batch | None] = ContextVar("pgjobs_batch", default=None)
_at_once: ContextVar[bool] = ContextVar("pgjobs_follow_up_at_once", default=False)


@contextmanager
def writing(made: Batch) -> Iterator[Batch]:
    """Within the block, jobs enqueued here join `made`, not yet saved (JobManager.batch)."""
    token = _current.set(made)
    try:
        yield made
    finally:
        _current.reset(token)


def member_of(queue: str) -> Batch | None:
    """The batch a job of `queue` enqueued here joins (None: no batch)."""
    made = _current.get()
    if made is not None and transport_of(queue) != POSTGRES:
        raise EnqueueError(
            f"queue {queue!r} is carried by {transport_of(queue)}, whose jobs leave the database "
            "when they are relayed: a batch can only follow jobs of PostgreSQL's queues. "
            "Enqueue it to one of those (queue=...), or outside the batch's block."
        )
    return made


# ---- dependencies -----------------------------------------------------------------------------


def targets(after: Iterable[Any]) -> tuple[list[UUID], list[UUID]]:
    """The job ids and batch ids `after` names (Jobs, Batches or their ids), checked."""
    Job, Batch = apps.get_model("pgjobs", "Job"), apps.get_model("pgjobs", "Batch")
    if isinstance(after, (str, bytes, UUID, Job, Batch)):
        after = [after]
    jobs: list[UUID] = []
    batches: list[UUID] = []
    for given in after:
        if isinstance(given, Batch):
            if given is _current.get():
                raise EnqueueError(
                    "after=: a batch is waited for after its block; this job is enqueued in "
                    "it. Enqueue the job after the with block."
                )
            batches.append(given.id)
        elif isinstance(given, Job):
            jobs.append(given.pk)
        else:
            try:
                jobs.append(given if isinstance(given, UUID) else UUID(str(given)))
            except ValueError:
                raise EnqueueError(
                    f"after=: {given!r} is not a job, a batch or a job's id."
                ) from None
    if not (jobs or batches):
        raise EnqueueError("after=[]: name at least one job or batch to wait for, or leave it out.")
    return jobs, batches


def add_dependencies(db: str, job: UUID, jobs: Sequence[UUID], batches: Sequence[UUID]) -> None:
    """Write that `job` waits for `jobs` and `batches` (an id of `jobs` may name a batch), in
    the enqueue's transaction, and judge it once that commits (some may have succeeded
    already)."""
    found = rows.execute(db, sql.DEPENDENCIES_FOUND, {"ids": [*jobs, *batches]})
    missing = [str(i) for i, queue, is_batch in found if queue is None and not is_batch]
    if missing:
        raise EnqueueError(
            f"after=: no job or batch {', '.join(missing)}: it was never written, or pruned."
        )
    relayed = [f"{i} ({q})" for i, q, _ in found if q and transport_of(q) != POSTGRES]
    if relayed:
        raise EnqueueError(
            f"after=: job {', '.join(relayed)} is of a queue carried by NATS, whose jobs leave "
            "the database when relayed: only jobs of PostgreSQL's queues can be waited for."
        )
    params = {
        "job": job,
        "jobs": [i for i, queue, _ in found if queue is not None],
        "batches": [i for i, queue, _ in found if queue is None],
    }
    rows.execute(db, sql.ADD_DEPENDENCIES, params)
    after_commit(db, waiters=[job])


# ---- following up -----------------------------------------------------------------------------


def follow_up(
    db: str,
    *,
    jobs: Iterable[UUID] = (),
    batches: Iterable[UUID] = (),
    waiters: Iterable[UUID] = (),
) -> int:
    """After `jobs` ended (committed): move their batches and `batches` (complete, succeed:
    their callbacks), and release or cancel the jobs waiting for them, and `waiters`; then the
    same for the jobs that cancelled. Each statement commits on its own. Returns how many
    batches and jobs moved."""
    jobs, batches, waiters = list(jobs), list(set(batches)), list(waiters)
    channel = wakeups.CHANNEL if get_settings().NOTIFY else None
    moves = 0
    while jobs or batches or waiters:
        moved: list[UUID] = []
        if jobs or batches:
            params = {"jobs": jobs, "batches": batches, "channel": channel}
            moved = [batch_id for batch_id, *_ in rows.execute(db, sql.FINISH_BATCHES, params)]
        changed = []
        if jobs or moved or waiters:
            params = {"jobs": jobs, "batches": moved, "waiters": waiters}
            changed = rows.execute(db, sql.RELEASE_WAITERS, params)
        cancelled = [(job_id, batch) for job_id, status, batch in changed if status == "cancelled"]
        jobs = [job_id for job_id, _ in cancelled]
        batches = list({batch_id for _, batch_id in cancelled if batch_id is not None})
        waiters = []
        moves += len(moved) + len(changed)
    return moves


def after_commit(
    db: str,
    *,
    jobs: Iterable[UUID] = (),
    batches: Iterable[UUID] = (),
    waiters: Iterable[UUID] = (),
) -> None:
    """`follow_up` once the current transaction commits (at once outside one). A failure is
    logged, not raised: what ended the jobs is written, and a sweep will follow them up."""
    jobs, batches, waiters = list(jobs), list(batches), list(waiters)
    if (jobs or batches or waiters) and _at_once.get():
        follow_up(db, jobs=jobs, batches=batches, waiters=waiters)
    elif jobs or batches or waiters:
        transaction.on_commit(
            lambda: follow_up(db, jobs=jobs, batches=batches, waiters=waiters),
            using=db,
            robust=True,
        )


@contextmanager
def at_once() -> Iterator[None]:
    """Within the block, follow-ups run at once, in the transaction: for testing.run_jobs() in
    a test's transaction, which never commits, and beside which nothing runs."""
    token = _at_once.set(True)
    try:
        yield
    finally:
        _at_once.reset(token)


@dataclass
class Sweep:
    """Where a worker's sweeps got to: each looks on from there, round to the start."""

    batch: UUID = field(default_factory=lambda: UUID(int=0))
    waiting: UUID = field(default_factory=lambda: UUID(int=0))
    revivable: int = 0

    def __call__(self, db: str) -> None:
        """Follow up what a lost follow-up left (its session died after its commit): the open
        batches, the waiting jobs and those a dependency cancelled, a few at a time."""
        found = rows.execute(db, sql.OPEN_BATCHES, {"after": self.batch, "limit": SWEEP_LIMIT})
        waiting = rows.execute(db, sql.WAITING_JOBS, {"after": self.waiting, "limit": SWEEP_LIMIT})
        params = {"after": self.revivable, "limit": SWEEP_LIMIT}
        revivable = rows.execute(db, sql.REVIVABLE_JOBS, params)
        self.batch = _next(found, UUID(int=0))
        self.waiting = _next(waiting, UUID(int=0))
        self.revivable = _next(revivable, 0)
        if found or waiting or revivable:
            follow_up(
                db, batches=[batch_id for (batch_id,) in found],
                waiters=list(dict.fromkeys(
                    [job_id for (job_id,) in waiting] + [job_id for _, job_id in revivable]
                )),
            )  # fmt: skip


def _next(found: list[Any], start: Any) -> Any:
    """Where the next sweep looks on from: after the last row found, or at the start when
    these were the last."""
    return found[-1][0] if len(found) == SWEEP_LIMIT else start


def prune(db: str, older_than: float, limit: int = 1000) -> int:
    """Delete dependencies whose job is gone and batches completed `older_than` seconds ago
    whose jobs are gone; returns how many."""
    gone = rows.execute(db, sql.PRUNE_DEPENDENCIES, {"limit": limit})
    params = {"older_than": older_than, "limit": limit}
    return len(gone) + len(rows.execute(db, sql.PRUNE_BATCHES, params))
