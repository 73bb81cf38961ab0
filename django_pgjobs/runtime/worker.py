"""The worker loop: claim into free slots, run handlers on threads, settle their outcomes in
batches, and stop gracefully. It decides *when*; the data layer decides *how*.

A little over 300 lines: the loop and the state it shares with its parts (settling, handlers,
leases, chores, controls), which live in the modules beside it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections, router

from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows
from django_pgjobs.errors import first_line
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.outcomes import Handled, Outcome
from django_pgjobs.runtime import execute, listener, policy
from django_pgjobs.runtime import handlers as timeouts
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime import sessions as served
from django_pgjobs.runtime.chores import (
    Chore,
    Promoter,
    Pruner,
    Reaper,
    Reporter,
    Scheduler,
    Ticker,
)
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.handlers import HandlerPool
from django_pgjobs.runtime.leases import RETRY_PAUSE, LeaseKeeper
from django_pgjobs.runtime.options import Exit, Options, worker_id
from django_pgjobs.runtime.positions import Positions
from django_pgjobs.runtime.reporting import (
    ActivityTally,
    Announcer,
    Outage,
    WorkerError,
    log_activity,
    log_outcome,
    quietly,
)
from django_pgjobs.runtime.sessions import LockWaits, application_name
from django_pgjobs.runtime.settling import Settler
from django_pgjobs.runtime.stopping import Stoppable

logger = logging.getLogger(__name__)


class Worker(Stoppable):
    """One worker process's runtime. ``run()`` returns how it ended (an Exit)."""

    def __init__(self, options: Options, chores: Sequence[Chore] = ()) -> None:
        """`chores`: more housekeeping for this worker (e.g. a NATS relay: jetstream/)."""
        super().__init__()
        self.options = options
        self.id = options.worker_id or worker_id()
        self.lease = options.lease or get_settings().LEASE
        self.db = router.db_for_write(Job)
        self.jobs = Job.objects.db_manager(self.db)
        self.activity = ActivityTally()
        self._handlers = HandlerPool(options.concurrency, self._handed_in, self.timeout_of)
        self._announcer = Announcer()  # outcome signals, off the main thread
        # Claimed and not yet settled, keyed by the claim (its Job object), never by job id: a
        # stale claim's outcome must not unregister a newer claim of the same job.
        self._in_flight: dict[int, Job] = {}
        self._lock = threading.Lock()  # guards _in_flight against the lease keeper
        self._settler = Settler(self)
        self.positions = Positions()  # where its claims got to in each queue
        self._exit = Exit.OK
        self._recorded = 0  # outcomes recorded, for --max-jobs-per-child
        self._poll_now = True  # set by wake-ups: claim at the next turn of the loop
        self._next_poll = 0.0
        self._poll_delay = 0.0
        self._mean_duration: float | None = None  # of recent handlers, for the prefetch
        self._last_claim_empty = False
        self.controls = QueueControls(options.queues, options.controls_interval)
        self._reaper = Reaper(self.jobs, options.reap_interval, self.poll_now, self.running_claims)
        self._chores: list[Chore] = [self._reaper, Promoter(self.jobs, options.promote_interval)]
        if not options.once:
            self._chores += [
                Pruner(self.jobs, options.prune_interval),
                Ticker(Scheduler(self.db, enqueued=self._announcer.enqueued)),
            ]
        self._chores += [*chores, Reporter(options.stats_interval, self._report)]
        self._lock_waits = LockWaits(self.db, application_name(self.id))
        self._leases = LeaseKeeper(
            self.jobs, self.running_claims, self.lease_of, self.lease, self._lock_waits
        )

    # ---- control ---------------------------------------------------------------------------

    def poll_now(self) -> None:
        self._poll_now = True
        self._wake.set()

    def run(self) -> Exit:
        """Run until stopped (or, with once, drained). WorkerError, with once, when the
        database cannot be used at all."""
        options = self.options
        quietly(
            logger.info,
            "worker %s started: queues=%s concurrency=%d batch=%d lease=%gs listen=%s",
            self.id, ",".join(options.queues), options.concurrency, options.batch_size,
            self.lease, "yes" if options.listen and not options.once else "no",
        )  # fmt: skip
        if options.parent_pid is None:  # a supervisor's children: it said so once for all
            served.warn(self.db, options.queues, f"worker {self.id}")
        locks.warn_of_a_small_pool(self.db, options.concurrency, f"worker {self.id}")
        self._lock_waits.limit_this_thread(plans=True)
        self._start_threads()
        # The loop makes and drops objects by the thousand a second, and each of the collector's
        # full passes would walk everything imported at start-up too (tens of milliseconds in a
        # Django process): what exists now is left out of its passes while the worker runs.
        # gc.unfreeze() at the end gives back everything frozen, what the interpreter or the
        # application froze before included (Python 3.12 starts with a few hundred objects
        # frozen): collectable again, as they would be without a freeze.
        gc.freeze()
        try:
            return self._loop()
        finally:
            gc.unfreeze()

    def _loop(self) -> Exit:
        options = self.options
        outage = Outage()
        while True:
            try:
                self._turn()
                # Over only once a turn reached the database: one that had nothing to do (all
                # slots busy, or stopping) ran no statement on the connection closed below.
                if connections[self.db].connection is not None:
                    if outage.failures and outage.database:  # its turn may have written nothing
                        rows.check_writable(self.db)
                    outage.over()
                    self._reaper.calm()
            except Exception as error:  # the database, or a bug (outages.py): pause, try again
                self._reaper.trouble(error)
                if options.once:
                    self._shutdown()
                    if not isinstance(error, DatabaseError):
                        raise
                    raise WorkerError(outage.describe(error)) from error
                pause = outage.failed(error)
                connections[self.db].close()
                self._poll_now = True  # after a reconnect, look at once
                self._pause(pause)
                if not self._stopping:
                    continue
            if self._stopping:
                if not self._in_flight or time.monotonic() >= self._deadline:
                    break
            elif options.once and self._last_claim_empty and not self._in_flight:
                break
            self._wake.wait(self._wait_time())
            self._wake.clear()
        return self._shutdown()

    # ---- the loop's steps ------------------------------------------------------------------

    def _turn(self) -> None:
        # First what needs no database: a worker whose supervisor is gone stops during an
        # outage too.
        self._check_limits()
        # Before claiming: never claim from a paused queue.
        if self.controls.read_if_due(self.db):
            self._poll_now = True  # a queue was resumed: look at once
        self._leases.stand_in()  # the lease keeper's rounds fail: leases are renewed here
        for job, decided in self._handlers.time_out():
            timeout = self.timeout_of(job) or 0.0
            self._settler.finished(job, execute.past_time_limit(job, timeout, decided, logger))
        began = time.monotonic()
        try:
            self._settler.settle_and_fetch()
        finally:
            self._announcer.flush()
        if time.monotonic() - began > policy.STALLED:
            self._reaper.stalled()
        self._check_abandoned(self._handlers.deadlines)
        if self._stopping:
            self._release_unstarted()
            self._note_recycle(len(self._in_flight))
            return
        # Nothing will start the jobs claimed for the threads before long: other workers may.
        held_up = self._handlers.held_up(policy.HELD_UP) >= self.options.concurrency
        if held_up and (given_back := self._release_unstarted()):
            quietly(
                logger.info,
                "gave back %d claimed jobs: every handler thread is busy with a job that has "
                "run for more than %gs", given_back, policy.HELD_UP,
            )  # fmt: skip
        for chore in self._chores:
            chore.run_if_due()

    def free_slots(self) -> int:
        options = self.options
        ready_soon = options.concurrency - self._handlers.held_up(policy.HELD_UP)
        extra = policy.prefetch(ready_soon, options.batch_size, self._mean_duration)
        return options.concurrency + extra - len(self._in_flight)

    def claim_wanted(self, freed: int) -> int:
        """How many jobs to claim this turn, `freed` slots being about to open (0: none)."""
        free = self.free_slots() + freed
        due = self._poll_now or time.monotonic() >= self._next_poll
        if self._stopping or free <= 0 or not due or self._leases.overdue():
            return 0
        self._poll_now = False
        return min(free, self.options.batch_size)

    def claim_limited(self, wanted: int, into: list[Job]) -> None:
        """Claim up to `wanted` jobs from the queues with a limit, into `into` (which keeps
        what was claimed if a later queue's claim fails)."""
        start = len(into)
        for queue_name in self.controls.limited:
            room = wanted - (len(into) - start)
            if room > 0:
                try:
                    into += self.jobs.claim_limited(
                        queue_name, worker=self.id, limit=room, lease=self.lease
                    )
                except DatabaseError as error:
                    if not rows.timed_out(error):
                        raise
                    # The controls' table is locked: this queue sits the turn out (the
                    # controls' own read says so, runtime/controls.py).

    def take(self, jobs: list[Job], wanted: int) -> None:
        """Hand claimed jobs to the handler threads, then schedule the next poll. They are the
        worker's before anything here can fail: a claim it did not know of would be neither
        run nor renewed, and would come back only at its lease's end, an attempt spent."""
        with self._lock:
            for job in jobs:
                self._in_flight[id(job)] = job
        for job in jobs:
            self._handlers.submit(job)
        self.activity.claimed(jobs)
        longer = [job for job in jobs if self.lease_of(job) > self.lease]
        if longer:  # tasks with a lease of their own get it at once
            self._leases.renew(longer)
        self._last_claim_empty = not jobs
        self._poll_delay = policy.poll_delay(
            self._poll_delay, len(jobs), wanted, self.options.poll_interval
        )
        # A short claim after the positions is followed by a sweep, whatever the poll delay.
        self._next_poll = min(
            time.monotonic() + self._poll_delay, self.positions.poll_by(len(jobs), wanted)
        )

    def settled(self, job: Job, handled: Handled, outcome: Outcome) -> None:
        """Forget a claim whose outcome was recorded (or refused), count and announce it."""
        with self._lock:
            self._in_flight.pop(id(job), None)
        self.activity.finished(job, outcome)
        self._recorded += 1
        if self.options.max_jobs and self._recorded >= self.options.max_jobs:
            self._recycle(f"it recorded {self._recorded} outcomes (--max-jobs-per-child)")
        if job.queue in self.controls.limited:
            self._poll_now = True  # a slot under the queue's limit is free again
        self._announcer.announce(job, handled, outcome)
        log_outcome(job, handled, outcome)

    def learn_durations(self, durations: list[float]) -> None:
        self._mean_duration = policy.mean_duration(self._mean_duration, durations)

    def running_claims(self) -> list[Job]:
        """Every claim this worker holds: waiting for a thread, running, or finished with its
        outcome not recorded yet (the lease keeper renews them all; this worker's reaper spares
        them). A finished job's outcome is usually recorded within moments, but not while the
        main loop's turns fail and the lease keeper's connection works: its lease must last
        until the outcome is written, or another worker would run the job again."""
        with self._lock:
            return list(self._in_flight.values())

    def timeout_of(self, job: Job) -> float | None:
        return execute.limits_of(job, self.lease)[1]

    def lease_of(self, job: Job) -> float:
        return execute.limits_of(job, self.lease)[0]

    def _report(self, seconds: float, stopping: bool = False) -> None:
        """Write what this worker did per queue since the last report (QueueStat rows), and
        log it in one line; `stopping`: the last report, which also says the worker stopped."""
        QueueStat.objects.using(self.db).bulk_create(
            self.activity.rows(self.id, seconds, self.options.queues, stopping)
        )
        activity, self.activity = self.activity, ActivityTally()  # kept until written
        log_activity(activity, seconds, len(self._in_flight))

    def _wait_time(self) -> float:
        """Until the next chore or poll; finishing handlers and wake-ups interrupt the wait."""
        waits = [chore.due_in() for chore in self._chores]
        waits.append(self._settler.due_in())
        waits.append(self._handlers.deadlines.next_in())
        if len(self._in_flight) > self.options.concurrency:  # jobs claimed beyond the threads:
            waits.append(policy.HELD_UP / 2)  # given back soon if every thread is held up
        if self._stopping:
            waits.append(self._deadline - time.monotonic())
        elif self._leases.overdue():  # no claim: renew the leases (stand_in) before long
            waits.append(RETRY_PAUSE)
        elif self.free_slots() > 0:
            waits.append(self._next_poll - time.monotonic())
        return max(0.0, min(waits))

    # ---- threads ---------------------------------------------------------------------------

    def _start_threads(self) -> None:
        self._handlers.start()
        if self.options.listen and not self.options.once:
            thread = threading.Thread(
                target=listener.listen,
                args=(self.db, self._on_notify, self.poll_now, lambda: self._stopping),
                kwargs={"name": application_name(self.id)},
                name="pgjobs-listener",
                daemon=True,
            )
            thread.start()
        self._leases.start()

    def _handed_in(self, job: Job, handled: Handled) -> None:
        if self._settler.finished(job, handled):
            self._wake.set()

    def _on_notify(self, queue_name: str) -> None:
        if queue_name in self.options.queues:
            self.poll_now()

    # ---- shutdown --------------------------------------------------------------------------

    def _release_unstarted(self) -> int:
        """Jobs claimed but not yet handed to a thread go back at once; returns how many."""
        unstarted = self._handlers.unstarted()
        if unstarted:
            try:
                self.jobs.release(unstarted)
            finally:
                with self._lock:
                    for job in unstarted:
                        self._in_flight.pop(id(job), None)
        return len(unstarted)

    def _shutdown(self) -> Exit:
        """Release what is left; say how the worker ended."""
        self._leases.stop()
        self._handlers.stop()
        self._handlers.close_decided()
        left = list(self._in_flight.values())
        clean = True
        try:
            self._settler.settle_and_fetch()
            # Told already (a Task whose task_finished receivers outlast the grace): recorded
            # as told, not released to run again.
            for job in list(self._in_flight.values()):
                if (decided := timeouts.decided_of(job)) is not None:
                    self._settler.finished(job, decided)
            self._settler.settle_and_fetch()
            left = list(self._in_flight.values())
            if left:
                released = self.jobs.release(left)
                quietly(
                    logger.warning,
                    "released %d unfinished jobs back to ready: %s",
                    len(released), ", ".join(str(pk) for pk in released),
                )  # fmt: skip
        except Exception as error:  # the database, or a bug: the process ends all the same
            clean = not left
            if left:
                quietly(
                    logger.error,
                    "could not release %d jobs (%s); they return when their leases expire",
                    len(left), first_line(error),
                )  # fmt: skip
        reporter = next(chore for chore in self._chores if isinstance(chore, Reporter))
        if not reporter.last(self.db, self.id):
            log_activity(self.activity, reporter.span(), len(self._in_flight))
        self._announcer.stop(within=policy.grace_left(self.options.grace, self._deadline))
        connections.close_all()
        self._lock_waits.stop()
        quietly(logger.info, "worker %s stopped", self.id)
        return self._exit if clean else Exit.UNRELEASED
