"""The worker loop, the one for every transport: claim into free slots, run handlers on threads,
settle their outcomes in batches, and stop gracefully. It decides *when*; its source (PostgreSQL,
or a NATS JetStream stream: `Source`) decides *how* jobs are taken and their outcomes kept."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections, router

from django_pgjobs import schema
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.outcomes import Handled
from django_pgjobs.runtime import execute, handlers, policy, sessions
from django_pgjobs.runtime.chores import Chore, Reporter
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.handlers import HandlerPool
from django_pgjobs.runtime.leases import RETRY_PAUSE
from django_pgjobs.runtime.lifecycle import Exit, Options, Stoppable, worker_id
from django_pgjobs.runtime.postgres import PostgresSource
from django_pgjobs.runtime.reporting import (
    ActivityTally,
    Announcer,
    Outage,
    WorkerError,
    log_activity,
    log_outcome,
    log_safely,
)
from django_pgjobs.runtime.sessions import warn_of_a_small_pool
from django_pgjobs.runtime.sources import Claims, Exchange, Finished, Recorded, Seat, Source

logger = logging.getLogger(__name__)


class Worker(Stoppable):
    """One worker process's runtime. ``run()`` returns how it ended (an Exit)."""

    def __init__(
        self, options: Options, source: Source | None = None, chores: Sequence[Chore] = ()
    ) -> None:
        """`source`: where the jobs come from (PostgreSQL when None); `chores`: more
        housekeeping (a NATS relay, say)."""
        super().__init__()
        self.options = options
        self.source = source = source or PostgresSource()
        self.id = options.worker_id or worker_id()
        self.lease = options.lease or get_settings().LEASE
        self.db = router.db_for_write(Job)
        self.jobs = Job.objects.db_manager(self.db)
        self.activity = ActivityTally()
        self.claims = Claims()
        self.controls = QueueControls(options.queues, options.controls_interval)
        self.finished = Finished(options, lambda: len(self.claims), lambda: self._stopping)
        self.handlers = HandlerPool(
            options.concurrency, self.hand_in, self.timeout_of, deadline_set=self._wake.set
        )
        self._announcer = Announcer()  # outcome signals, off the main thread
        self._exit = Exit.OK
        self._recorded = 0  # outcomes recorded, for --max-jobs-per-child
        self._poll_now = True  # set by wake-ups: claim at the next turn of the loop
        self._next_poll = 0.0
        self._poll_delay = 0.0
        self._mean_duration: float | None = None  # of recent handlers, for the prefetch
        self._last_claim_empty = False
        seat = Seat(
            self.id, self.db, self.lease, options, self.controls, self.claims,
            self._announcer, self.poll_now, lambda: self._stopping, lambda: self._deadline,
        )  # fmt: skip
        source.attach(seat)
        yielding = []
        if options.yielding and source.yields:
            settings = get_settings()
            budgets = {queue: settings.yield_budget(queue) for queue in options.queues}
            yielding.append(self.controls.yield_to(self.db, budgets, settings.YIELD_FLOOR))
        self._chores = [
            *source.chores,
            *chores,
            *yielding,
            Reporter(options.stats_interval, self._report),
        ]

    # ---- control ---------------------------------------------------------------------------

    def poll_now(self) -> None:
        self._poll_now = True
        self._wake.set()

    def hand_in(self, job: Job, handled: Handled) -> None:
        """A handler thread's job ended: its outcome is kept at a turn soon."""
        if self.finished.hand_in(job, handled):
            self._wake.set()

    def run(self) -> Exit:
        """Run until stopped (or, with once, drained). WorkerError, with once, when the
        database cannot be used at all."""
        options = self.options
        refuse_unmigrated(self.db)
        log_safely(
            logger.info,
            "worker %s started: %s=%s concurrency=%d batch=%d lease=%gs listen=%s",
            self.id, self.source.queues_are, ",".join(options.queues), options.concurrency,
            options.batch_size,
            self.lease, "yes" if options.listen and not options.once else "no",
        )  # fmt: skip
        if options.parent_pid is None:  # a supervisor's children: it said so once for all
            sessions.warn(self.db, options.queues, f"worker {self.id}")
        warn_of_a_small_pool(self.db, options.concurrency, f"worker {self.id}")
        self.source.start()
        self.handlers.start()
        # The loop makes and drops objects by the thousand a second: what exists now (all that
        # start-up imported) is left out of the collector's full passes while the worker runs.
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
                # Over once a turn reached the database: one with nothing to do ran no statement
                # on the connection closed below.
                if connections[self.db].connection is not None or not outage.database:
                    if outage.failures and outage.database:  # its turn may have written nothing
                        rows.check_writable(self.db)
                    outage.over()
            except Exception as error:  # the database, or a bug (reporting.Outage): pause, again
                self.source.failed(error)
                # With --once, the database's errors end the run at once; another's (a NATS
                # stream the relay has not made yet) is tried a few times first.
                if options.once and (isinstance(error, DatabaseError) or outage.failures >= 5):
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
                if not self.claims or time.monotonic() >= self._deadline:
                    break
            elif options.once and self._last_claim_empty and not self.claims:
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
        for job, kept in self.handlers.time_out():
            timeout = self.timeout_of(job) or 0.0
            self.finished.hand_in(job, execute.past_time_limit(job, timeout, kept, logger))
        # Before the claim: a worker to be recycled takes nothing more (a NATS fetch may wait).
        self._check_abandoned(self.handlers.deadlines)
        try:
            self.settle_and_claim()
        finally:
            self._announcer.flush()
        if self._stopping:
            self._give_back_unstarted()
            self._note_recycle(len(self.claims))
            return
        # Nothing will start the jobs claimed for the threads before long: other workers may.
        all_busy = self.handlers.busy(policy.BUSY_AFTER) >= self.options.concurrency
        if all_busy and (given_back := self._give_back_unstarted()):
            log_safely(
                logger.info,
                "gave back %d claimed jobs: every handler thread is busy with a job that has "
                "run for more than %gs", given_back, policy.BUSY_AFTER,
            )  # fmt: skip
        for chore in self._chores:
            chore.run_if_due()

    def settle_and_claim(self) -> None:
        """One exchange with the source: keep the finished outcomes that are due, and claim
        into the free slots."""
        finished = self.finished.take()
        if finished:
            self.learn_durations([handled.duration for _, handled in finished])
        # Outcomes not due yet: the claim waits for them, to share their statement.
        wanted = 0 if finished is None else self._claim_wanted(freed=len(finished))
        finished = finished or []
        turn = Exchange()
        try:
            self.source.exchange(finished, wanted, self._fetch_wait(), turn)
        except Exception:
            self.finished.put_back(finished)  # what the source did not take charge of
            raise
        finally:
            # Recorded and claimed are the worker's whatever went wrong after.
            for recorded in turn.recorded:
                self._settled(recorded)
            if turn.recorded and not self._stopping:
                self._check_memory()
            if wanted:
                self.take(turn.claimed, wanted, turn.poll_by, turn.held)

    def learn_durations(self, durations: list[float]) -> None:
        self._mean_duration = policy.mean_duration(self._mean_duration, durations)

    def free_slots(self) -> int:
        options = self.options
        ready_soon = options.concurrency - self.handlers.busy(policy.BUSY_AFTER)
        extra = policy.prefetch(ready_soon, options.batch_size, self._mean_duration)
        return options.concurrency + extra - len(self.claims)

    def _claim_wanted(self, freed: int) -> int:
        """How many jobs to claim this turn, `freed` slots being about to open (0: none)."""
        free = self.free_slots() + freed
        due = self._poll_now or time.monotonic() >= self._next_poll
        if self._stopping or free <= 0 or not due or not self.source.can_claim():
            return 0
        wanted = self.controls.admit(min(free, self.options.batch_size))
        if wanted:  # else a queue yields: claimed once it may (_wait_time)
            self._poll_now = False
        return wanted

    def _fetch_wait(self) -> float:
        """How long a source that waits for jobs itself may wait this turn: not while handlers
        run (their outcomes wait for it), else until the next chore or time limit."""
        if self.claims:
            return 0.0
        waits = [chore.due_in() for chore in self._chores]
        waits.append(self.handlers.deadlines.next_in())
        return max(0.0, min([self.options.poll_interval, *waits]))

    def take(
        self, jobs: list[Job], wanted: int, poll_by: float = float("inf"), held: bool = False
    ) -> None:
        """Hand claimed jobs (`wanted` were asked for) to the handler threads, then schedule
        the next poll (by `poll_by` at the latest; `held`: a limit held due jobs back). They
        are the worker's before anything here can fail: a claim it did not know of would be
        neither run nor renewed, and would come back only at its lease's end, an attempt
        spent."""
        self.claims.add(jobs)
        for job in jobs:
            self.handlers.submit(job)
        self.activity.claimed(jobs)
        self.controls.took(jobs, wanted)
        longer = [job for job in jobs if self.lease_of(job) > self.lease]
        if longer:  # tasks with a lease of their own get it at once
            self.source.renew(longer)
        self._last_claim_empty = not jobs and not held
        self._poll_delay = policy.poll_delay(
            self._poll_delay, len(jobs), wanted, self.options.poll_interval
        )
        self._next_poll = min(time.monotonic() + self._poll_delay, poll_by)

    def _settled(self, recorded: Recorded) -> None:
        """Forget a claim whose outcome was recorded (or refused), count and announce it."""
        job, handled, outcome, logged = recorded
        self.claims.forget([job])
        self.activity.finished(job, outcome, handled.duration)
        self._recorded += 1
        if self.options.max_jobs and self._recorded >= self.options.max_jobs:
            self._recycle(f"it recorded {self._recorded} outcomes (--max-jobs-per-child)")
        if job.queue in self.controls.limited or job.limit_key is not None:
            self._poll_now = True  # a slot under a limit is free again
        self._announcer.announce(job, handled, outcome)
        if not logged:
            log_outcome(job, handled, outcome)

    def _give_back_unstarted(self) -> int:
        """Jobs claimed but not yet handed to a thread go back at once; returns how many. Those
        that cannot be given back now run here after all."""
        unstarted = self.handlers.unstarted()
        if not unstarted:
            return 0
        try:
            self.source.give_back(unstarted)
        except Exception:
            for job in unstarted:  # in the order they came
                self.handlers.submit(job)
            raise
        self.claims.forget(unstarted)
        return len(unstarted)

    def timeout_of(self, job: Job) -> float | None:
        return execute.limits_of(job, self.lease)[1]

    def lease_of(self, job: Job) -> float:
        return execute.limits_of(job, self.lease)[0]

    def _report(self, seconds: float, stopping: bool = False) -> None:
        """Write what this worker did per queue since the last report (QueueStat rows), and
        log it in one line; `stopping`: the last report, which also says the worker stopped."""
        written = self.activity.rows(self.id, seconds, self.options.queues, stopping)
        yielding = self.controls.yield_figures()
        for row in written:
            if row.seconds:
                for name, value in yielding.get(row.queue, {}).items():
                    setattr(row, name, value)
        QueueStat.objects.using(self.db).bulk_create(written)
        self.controls.reported()
        activity, self.activity = self.activity, ActivityTally()  # kept until written
        log_activity(activity, seconds, len(self.claims))

    def _wait_time(self) -> float:
        """Until the next chore or poll; finishing handlers and wake-ups interrupt the wait."""
        waits = [chore.due_in() for chore in self._chores]
        waits += [self.finished.due_in(), self.source.due_in()]
        waits.append(self.handlers.deadlines.next_in())
        if len(self.claims) > self.options.concurrency:  # jobs claimed beyond the threads:
            waits.append(policy.BUSY_AFTER / 2)  # given back soon if every thread is busy
        if self._stopping:
            waits.append(self._deadline - time.monotonic())
        elif not self.source.can_claim():  # no claim: the leases are renewed here before long
            waits.append(RETRY_PAUSE)
        elif (free := self.free_slots()) > 0:
            held = self.controls.next_in(min(free, self.options.batch_size))
            waits.append(max(self._next_poll - time.monotonic(), held))
        return max(0.0, min(waits))

    # ---- shutdown --------------------------------------------------------------------------

    def _shutdown(self) -> Exit:
        """Keep what finished, return what is left to the source; say how the worker ended."""
        with contextlib.suppress(Exception):  # what cannot be given back is returned below
            self._give_back_unstarted()
        self.handlers.stop()
        self.handlers.stop_hand_ins()
        recorded: list[Recorded] = []
        clean = True
        try:
            self.settle_and_claim()
            # Told already (a Task whose task_finished receivers outlast the grace): recorded
            # as told, not returned to run again.
            for claim in self.claims.all():
                if (kept := handlers.kept_outcome(claim.job)) is not None:
                    self.finished.hand_in(claim.job, kept)
            self.settle_and_claim()
        except Exception as error:  # the database, or a bug: what is left is returned below
            log_safely(logger.warning, "could not record every outcome at the stop: %s", error)
        finally:
            recorded, clean = self.source.shutdown(self.claims.all())
        for each in recorded:
            self._settled(each)
        reporter = next(chore for chore in self._chores if isinstance(chore, Reporter))
        if not reporter.last(self.db, self.id):
            log_activity(self.activity, reporter.span(), len(self.claims))
        self.source.close()
        self._announcer.stop(within=policy.grace_left(self.options.grace, self._deadline))
        connections.close_all()
        log_safely(logger.info, "worker %s stopped", self.id)
        return self._exit if clean else Exit.UNRELEASED


def refuse_unmigrated(db: str) -> None:
    """WorkerError when this app's first migration was never applied on `db`: a worker has
    nothing to work on, and would only fail every statement. Not known while the database
    cannot be reached: the loop says so, and tries again."""
    try:
        pending = schema.pending_migrations(db)
    except DatabaseError:
        return
    finally:
        connections[db].close()
    if pending and pending[0].startswith("0001"):
        raise WorkerError(
            f"the pgjobs tables do not exist on the database '{db}': run `manage.py migrate`, "
            "then start the worker again"
        )
