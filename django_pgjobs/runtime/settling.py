"""Outcome batching: handler threads hand in how their jobs ended, and the worker's main thread
records them with its next claim, one statement a turn. A batch the database refuses is
recorded again job by job, so one bad outcome can never wedge the worker; outcomes whose rows
another session holds locked are held back, so one locked row never stalls the others."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from django.db import DatabaseError

from django_pgjobs.data import rows
from django_pgjobs.data.records import FailedAttempt, Failure, Settled, claim_of
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.reporting import quietly

if TYPE_CHECKING:
    from django_pgjobs.runtime.worker import Worker

logger = logging.getLogger(__name__)

#: How long outcomes whose rows another session held locked wait before they are tried again
#: (each time only once their rows are free: they never make a turn wait for a lock again).
HELD_RETRY = 1.0


class Settler:
    """The finished jobs waiting to be recorded, and how they are."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._done: list[tuple[Job, Handled]] = []
        self._first_at = 0.0  # when the oldest unsettled outcome came in
        self._lock = threading.Lock()
        # Outcomes whose rows another session held locked, and when to try them again; the
        # main thread's alone. The lease keeper renews their claims, as it does every claim held.
        self._held: list[tuple[Job, Handled]] = []
        self._held_until = 0.0

    def finished(self, job: Job, handled: Handled) -> bool:
        """Hand in a finished job (from its handler thread). True when the main thread should
        wake: for the first outcome (it then waits at most SETTLE_DELAY for others) and when
        the outcomes are due, not for every one of them."""
        with self._lock:
            first = not self._done
            if first:
                self._first_at = time.monotonic()
            self._done.append((job, handled))
            return first or self._due()

    def due_in(self) -> float:
        held = self._held_until - time.monotonic() if self._held else float("inf")
        with self._lock:
            if not self._done:
                return held
            return min(held, self._first_at + policy.SETTLE_DELAY - time.monotonic())

    def _due(self) -> bool:
        worker, options = self.worker, self.worker.options
        return worker._stopping or policy.settle_due(
            len(self._done), len(worker._in_flight), options.concurrency, options.batch_size,
            time.monotonic() - self._first_at,
        )  # fmt: skip

    def settle_and_fetch(self) -> None:
        """Record the finished outcomes and claim into the free slots, in one statement; a
        Retry asked by a handler is recorded on its own, and so is each claim from a queue
        with a limit."""
        worker = self.worker
        with self._lock:
            if not self._due():
                return
            done, self._done = self._done, []
        worker.learn_durations([handled.duration for _, handled in done])
        limited: list[Job] = []  # claimed from queues with a limit
        wanted = 0
        try:
            done += self._held_now_free()
            succeeded = [(job, h) for job, h in done if h.verdict is Verdict.SUCCEEDED]
            failed = [(job, h) for job, h in done if h.verdict is Verdict.ERROR]
            for job, handled in done:
                if handled.verdict is Verdict.RETRY:
                    owned = worker.jobs.retry_later(job, handled.delay)
                    worker.settled(job, handled, Outcome.RETRIED if owned else Outcome.LOST)
            wanted = worker.claim_wanted(len(succeeded) + len(failed))
            if not (wanted or succeeded or failed):
                return
            if wanted:
                # Limited queues first, up to their share of the turn, so that a backlog in an
                # open queue cannot starve them; what they leave goes to the open queues.
                worker.claim_limited(wanted - worker.controls.open_share(wanted), into=limited)
            try:
                settled = self._record(succeeded, failed, wanted - len(limited))
            except DatabaseError as error:
                held = self._hold_locked(error, [*succeeded, *failed])
                if not held:
                    raise
                done = [item for item in done if id(item[0]) not in held]
                succeeded = [item for item in succeeded if id(item[0]) not in held]
                failed = [item for item in failed if id(item[0]) not in held]
                settled = self._record(succeeded, failed, wanted - len(limited))
        except Exception:
            # Keep what was not recorded (whatever failed: the database, or a bug); it is tried
            # again at the next turn. Recording twice is harmless: the guard refuses the second
            # write.
            with self._lock:
                self._done[:0] = [item for item in done if id(item[0]) in worker._in_flight]
            if limited:  # claimed: they run
                worker.take(limited, wanted)
            raise
        try:
            for job, handled in [*succeeded, *failed]:
                recorded = settled.recorded.get(claim_of(job))
                worker.settled(job, handled, Outcome.of_status(recorded))
        finally:  # committed claims are the worker's, whatever the bookkeeping above raised
            if wanted:
                worker.take(limited + settled.claimed, wanted)
        if settled.unread is not None:  # the claims were given back; the outcomes are recorded
            raise settled.unread

    def _held_now_free(self) -> list[tuple[Job, Handled]]:
        """The held outcomes due to be tried again whose rows are free now (the others stay
        held); none before their time, unless the worker is stopping."""
        if not self._held or (time.monotonic() < self._held_until and not self.worker._stopping):
            return []
        locked = self.worker.jobs.locked_elsewhere([job for job, _ in self._held])
        free = [item for item in self._held if claim_of(item[0])[0] not in locked]
        self._held = [item for item in self._held if claim_of(item[0])[0] in locked]
        self._held_until = time.monotonic() + HELD_RETRY
        return free

    def _hold_locked(self, error: DatabaseError, outcomes: list[tuple[Job, Handled]]) -> set[int]:
        """After the turn's statement ran out of time (its lock_timeout, or a statement_timeout
        of the project's that is shorter): hold back the outcomes whose rows another session
        holds locked, to be recorded once they are free. Returns them (as id(job), the worker's
        key of a claim); none when `error` is not such a wait or no row is locked."""
        if not (outcomes and rows.timed_out(error)):
            return set()
        locked = self.worker.jobs.locked_elsewhere([job for job, _ in outcomes])
        held = [item for item in outcomes if claim_of(item[0])[0] in locked]
        if held:
            self._held += held
            self._held_until = time.monotonic() + HELD_RETRY
            quietly(
                logger.warning,
                "the rows of %d finished jobs are locked by another session (%s); recording "
                "the other outcomes, and those once their rows are free",
                len(held), ", ".join(str(job.pk) for job, _ in held),
            )  # fmt: skip
        return {id(job) for job, _ in held}

    def _record(
        self,
        succeeded: list[tuple[Job, Handled]],
        failed: list[tuple[Job, Handled]],
        limit: int,
    ) -> Settled:
        """Record the outcomes and claim up to `limit` jobs from the open queues."""
        worker = self.worker
        try:
            started = time.monotonic()
            settled: Settled = worker.jobs.settle_and_claim(
                [job for job, _ in succeeded],
                [_attempt(job, handled) for job, handled in failed],
                worker.controls.open,
                worker=worker.id,
                limit=limit,
                lease=worker.lease,
                results=_results(succeeded),
                after=worker.positions.for_turn() if limit > 0 else None,
            )
            if limit > 0:
                worker.positions.turned(settled.claimed, time.monotonic() - started)
                rows.replan(worker.db, backlog=len(settled.claimed) == limit)
            return settled
        except DatabaseError as error:
            if rows.connection_lost(error):
                raise  # the connection: tried again after the reconnect
            if not (succeeded or failed):
                raise  # only a claim: nothing of a job's to blame (e.g. a missing table)
            quietly(
                logger.error,
                "the database refused a batch of %d outcomes (%s); recording them one by one",
                len(succeeded) + len(failed), str(error).strip().splitlines()[0],
            )  # fmt: skip
            worker.poll_now()  # the claim is taken again at the next turn
            return self._one_by_one(succeeded, failed)

    def _one_by_one(
        self, succeeded: list[tuple[Job, Handled]], failed: list[tuple[Job, Handled]]
    ) -> Settled:
        """Record each outcome in its own statement; one the database refuses again is
        recorded as a permanent failure saying why (a dead letter, never retried forever)."""
        jobs, worker = self.worker.jobs, self.worker.id
        result = Settled(set(), {}, [], {})
        for job, handled in [*succeeded, *failed]:
            one = [job] if handled.verdict is Verdict.SUCCEEDED else []
            attempt = [] if one else [_attempt(job, handled)]
            try:
                settled = jobs.settle_and_claim(
                    one, attempt, [], worker=worker, limit=0, results=_results([(job, handled)])
                )
            except DatabaseError as error:
                if rows.connection_lost(error):
                    raise
                job.progress = None  # nothing of the refused outcome's may be refused again
                refused = Failure(
                    "django_pgjobs.OutcomeRefused",
                    f"the database refused to record this attempt's outcome "
                    f"({handled.verdict.value}): {str(error).strip()}",
                )
                status = jobs.fail(job, refused, permanent=True, delay=0)
                recorded = {claim_of(job): status} if status else {}
                settled = Settled(set(), {}, [], recorded)
                quietly(logger.error, "job %s (%s): %s", job.pk, job.task, refused.message)
            result.recorded.update(settled.recorded)
        return result


def _attempt(job: Job, handled: Handled) -> FailedAttempt:
    assert handled.failure is not None
    return FailedAttempt(job, handled.failure, handled.permanent, handled.delay)


def _results(succeeded: list[tuple[Job, Handled]]) -> dict[object, str]:
    return {
        claim_of(job)[0]: handled.result_json
        for job, handled in succeeded
        if handled.verdict is Verdict.SUCCEEDED and handled.result_json is not None
    }
