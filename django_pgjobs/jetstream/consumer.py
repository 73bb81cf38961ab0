"""`runjobs --queue <a NATS queue>`: a worker that runs jobs from the queues' durable JetStream
consumers, on the same handler threads and with the same handlers as a PostgreSQL worker.

How an attempt ends (runtime/execute.py classifies it as for any job) becomes the message's
(jetstream/answers.py):

- succeeded: acknowledged;
- Retry(delay): negatively acknowledged with that delay (it counts as a delivery);
- an error: written back by the worker's own rule (JobManager.write_back). With attempts left,
  nothing is written and the message is negatively acknowledged with the task's backoff as its
  delay; otherwise the job is written back to PostgreSQL as a dead letter and the message is
  terminated. A job's attempts are its deliveries (plus those it made before it entered the
  stream), so a message delivered more often than its job's max_attempts without an outcome
  (its workers died) is dead-lettered without running again, as the reaper does.

What is sent to the server for each message (answers sent until confirmed, in-progress
acknowledgements while its handler runs, a message never started given back) is the
Acknowledger's (jetstream/acknowledging.py), which the worker owns.

The loop and the state its parts share (fetching, settling, stopping), as runtime/worker.py is
for PostgreSQL queues.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections, router
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.js.errors import NotFoundError

from django_pgjobs.conf import get_settings
from django_pgjobs.data.records import Failure
from django_pgjobs.jetstream import messages
from django_pgjobs.jetstream.acknowledging import Acknowledger
from django_pgjobs.jetstream.answers import answer, nak_limit
from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.consumers import Consumers
from django_pgjobs.jetstream.deliveries import Delivery, DeliveryCounts
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime import execute, policy
from django_pgjobs.runtime import handlers as timeouts
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime.chores import Chore, Reporter
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.handlers import HandlerPool
from django_pgjobs.runtime.options import Exit, Options, worker_id
from django_pgjobs.runtime.reporting import (
    ActivityTally,
    Announcer,
    log_activity,
    log_outcome,
    quietly,
)
from django_pgjobs.runtime.stopping import Stoppable
from django_pgjobs.transports import NatsQueue

logger = logging.getLogger(__name__)

#: Seconds a fetch waits for messages while handlers run (their outcomes wait for it).
BUSY_FETCH = 0.05

#: The most of the ack wait an idle fetch waits for messages: what came last still has most of
#: its fence (2/3 of the ack wait) to run in.
FETCH_SHARE = 0.25


class NatsWorker(Stoppable):
    """One worker process for NATS queues. ``run()`` returns how it ended (an Exit)."""

    def __init__(
        self, options: Options, queues: Sequence[NatsQueue], bridge: Bridge, chores: list[Chore]
    ) -> None:
        super().__init__()
        self.options, self.queues, self.bridge = options, list(queues), bridge
        self._queues = {queue.queue: queue for queue in self.queues}
        self.id = options.worker_id or worker_id()
        self.lease = options.lease or get_settings().LEASE
        self.db = router.db_for_write(Job)
        self.jobs = Job.objects.db_manager(self.db)
        self.activity = ActivityTally()
        self.controls = QueueControls([q.queue for q in self.queues], options.controls_interval)
        self._handlers = HandlerPool(options.concurrency, self._handed_in, self._timeout_of)
        self._announcer = Announcer()  # outcome signals, off the main thread
        self._lock = threading.Lock()  # guards _in_flight and _done
        self._in_flight: dict[int, Delivery] = {}  # by claim (the Job object)
        self._done: list[tuple[Job, Handled]] = []
        self._acks = Acknowledger(
            self.id, bridge, self.lease, self._in_flight, self._lock, self._handlers,
            stopping=lambda: self._stopping, settled=self._settled,
        )  # fmt: skip
        self._consumers = Consumers(
            self.id, bridge, self.queues, self.lease, self.db, lambda: self._stopping
        )
        self._chores = [*chores, Reporter(options.stats_interval, self._report)]
        # Its own sessions as a PostgreSQL worker's (runtime/locks.py), durable: a job written
        # back (a retry handed to PostgreSQL, a dead letter) must outlive a crash of the server
        # once its message is acknowledged.
        self._lock_waits = locks.LockWaits(self.db, locks.application_name(self.id), durable=True)
        self._fetched_nothing = False
        self._mean_duration: float | None = None  # of recent handlers, for the prefetch
        self._recorded = 0  # outcomes answered, for --max-jobs-per-child
        self._delivery_counts = DeliveryCounts()
        self._exit = Exit.OK

    # ---- control ---------------------------------------------------------------------------

    def run(self) -> Exit:
        options = self.options
        quietly(
            logger.info,
            "worker %s started: NATS queues=%s concurrency=%d lease=%gs",
            self.id, ",".join(q.queue for q in self.queues), options.concurrency, self.lease,
        )  # fmt: skip
        locks.warn_of_a_small_pool(self.db, options.concurrency, f"worker {self.id}")
        self._lock_waits.limit_this_thread()
        self._handlers.start()
        keeper = threading.Thread(
            target=self._acks.keep_in_progress,
            args=(self._consumers.read,),
            name="pgjobs-nats-acks",
        )
        keeper.daemon = True
        keeper.start()
        failures = 0
        while True:
            try:
                self._turn()
                failures = 0
            except Exception as error:  # NATS or the database: wait, then carry on
                failures += 1
                pause = policy.outage_pause(failures)
                quietly(
                    logger.warning,
                    "worker %s: %s: %s; trying again in %.1fs",
                    self.id, type(error).__name__, error, pause,
                )  # fmt: skip
                if isinstance(error, DatabaseError):
                    connections[self.db].close()
                if isinstance(error, NotFoundError | ConnectionClosedError):
                    self._consumers.forget()
                if options.once and failures > 5:
                    break
                self._pause(pause)
            if self._stopping:
                if not self._in_flight or time.monotonic() >= self._deadline:
                    break
                self._wake.wait(0.05)
                self._wake.clear()
            elif options.once and self._fetched_nothing and not self._in_flight:
                break
        return self._shutdown()

    # ---- the loop ----------------------------------------------------------------------------

    def _turn(self) -> None:
        self._check_limits()  # first: it needs no database, nor NATS
        self.controls.read_if_due(self.db)
        for job, decided in self._handlers.time_out():
            timeout = self._timeout_of(job) or 0.0
            self._finished(job, execute.past_time_limit(job, timeout, decided, logger))
        try:
            self._settle()
        finally:
            self._announcer.flush()
        self._check_abandoned(self._handlers.deadlines)
        if self._stopping:
            self._acks.give_back_unstarted()
            self._note_recycle(len(self._in_flight))
            return
        # Nothing will start the messages fetched for the threads before long: other workers
        # may (as a PostgreSQL worker gives back its unstarted claims).
        held_up = self._handlers.held_up(policy.HELD_UP) >= self.options.concurrency
        if held_up and (given_back := self._acks.give_back_unstarted()):
            quietly(
                logger.info,
                "worker %s gave back %d fetched messages: every handler thread is busy with a "
                "job that has run for more than %gs", self.id, given_back, policy.HELD_UP,
            )  # fmt: skip
        for chore in self._chores:
            chore.run_if_due()
        self._fetch()

    def _fetch(self) -> None:
        """Take messages into the free handler slots, from each served queue in turn; wait
        for a handler or a chore when there was nothing to take."""
        taking = set(self.controls.open) | set(self.controls.limited)  # paused: not fetched
        subscriptions = [(queue, self._consumers.subscription(queue)) for queue in self.queues]
        fetched, waited = 0, False
        for queue, subscription in subscriptions:
            free = self._free_slots()
            if free <= 0 or queue.queue not in taking:
                continue
            busy = bool(self._in_flight) or len(self.queues) > 1
            wait = BUSY_FETCH if busy else min(self.options.poll_interval, self._chore_wait())
            # A message's hold counts from the request (the server's ack wait may start as soon
            # as it is sent): one that came at the end of a long wait would be past its fence
            # (jetstream/deliveries.py) before its handler started, and delivered again.
            wait = max(min(wait, self._acks.ack_wait * FETCH_SHARE), BUSY_FETCH)
            sent_at = time.monotonic()  # the server holds what comes from this on from then
            batch = self.bridge.fetch(subscription, min(free, self.options.batch_size), wait)
            waited = waited or wait > BUSY_FETCH
            fetched += len(batch)
            self._take(batch, sent_at)
        self._fetched_nothing = not fetched
        if not (fetched or waited or self._done):
            # Full, paused, or nothing came while handlers run: until one finishes (it wakes
            # the loop), a chore or a time limit is due, or the next poll.
            self._wake.wait(min(self.options.poll_interval, self._chore_wait()))
            self._wake.clear()

    def _free_slots(self) -> int:
        """The handler threads, plus a prefetch of what they start within a moment (the
        PostgreSQL worker's rule, runtime/policy.prefetch: none for threads held up by a long
        job), less what is in flight."""
        options = self.options
        ready_soon = options.concurrency - self._handlers.held_up(policy.HELD_UP)
        extra = policy.prefetch(ready_soon, options.batch_size, self._mean_duration)
        return options.concurrency + extra - len(self._in_flight)

    def _take(self, batch: list[Msg], sent_at: float) -> None:
        jobs = []
        for msg in batch:
            try:
                delivered = self._delivery_counts.of(msg)
                job = messages.job_of(msg, self.id, delivered)
            except Exception as error:  # malformed, of another shape, nested too deep, ...
                # Not a message of ours (published by hand, or by a newer release): it would
                # come back forever, so it is terminated and said once.
                quietly(logger.error, "worker %s: terminated a message it cannot read (%s: %s)",
                        self.id, type(error).__name__, error)  # fmt: skip
                self.bridge.settle([], [], [msg])
                continue
            with self._lock:
                self._in_flight[id(job)] = Delivery(job, msg, held_at=sent_at, count=delivered)
            if job.attempts > job.max_attempts:
                # Delivered again and again without an outcome: its workers died, as a job
                # whose lease expired with no attempts left (the reaper's rule).
                lost = Failure("WorkerLost", f"delivered {job.attempts} times without an outcome")
                self._finished(job, Handled(Verdict.ERROR, failure=lost, permanent=True))
                continue
            jobs.append(job)
        self.activity.claimed(jobs)
        for job in jobs:
            self._handlers.submit(job)

    def _handed_in(self, job: Job, handled: Handled) -> None:
        self._finished(job, handled)
        self._wake.set()

    def _finished(self, job: Job, handled: Handled) -> None:
        with self._lock:
            self._done.append((job, handled))

    def _settle(self) -> None:
        """Turn finished attempts into acknowledgements (and dead letters), and send those
        not confirmed yet. An attempt whose delivery is no longer the worker's is not
        answered: another delivery decides its job's outcome."""
        with self._lock:
            done, self._done = self._done, []
        if done:
            durations = [handled.duration for _, handled in done]
            self._mean_duration = policy.mean_duration(self._mean_duration, durations)
        try:
            while done:
                job, handled = done[0]
                delivery = self._in_flight[id(job)]
                if delivery.ours(self._acks.ack_wait):
                    limit = nak_limit(
                        delivery.msg.metadata.timestamp,
                        self._acks.ack_wait,
                        self._queues[job.queue].max_age,
                    )
                    redelivered = delivery.count > 1
                    reply, delay, outcome = answer(self.jobs, job, handled, limit, redelivered)
                    delivery.decide(reply, delay, handled, outcome)
                    self._acks.unanswered.append(delivery)
                else:
                    self._acks.not_acknowledged(delivery, handled)
                done.pop(0)
        except DatabaseError:
            with self._lock:  # what was not written back is tried again
                self._done[:0] = done
            raise
        finally:
            self._acks.send()

    def _settled(self, job: Job, handled: Handled, outcome: Outcome, logged: bool = False) -> None:
        """Record an attempt whose answer is done with (the Acknowledger's `settled`)."""
        with self._lock:
            self._in_flight.pop(id(job), None)
        self._recorded += 1
        if self.options.max_jobs and self._recorded >= self.options.max_jobs:
            self._recycle(f"it recorded {self._recorded} outcomes (--max-jobs-per-child)")
        self.activity.finished(job, outcome)
        self._announcer.announce(job, handled, outcome)
        if not logged:
            log_outcome(job, handled, outcome)

    def _timeout_of(self, job: Job) -> float | None:
        return execute.limits_of(job, self.lease)[1]

    def _chore_wait(self) -> float:
        """Until the next chore or time limit."""
        waits = [chore.due_in() for chore in self._chores]
        return max(0.0, min([*waits, self._handlers.deadlines.next_in()]))

    def _report(self, seconds: float, stopping: bool = False) -> None:
        """As Worker._report: `stopping`, the last report, also says the worker stopped."""
        queues = [q.queue for q in self.queues]
        QueueStat.objects.using(self.db).bulk_create(
            self.activity.rows(self.id, seconds, queues, stopping)
        )
        activity, self.activity = self.activity, ActivityTally()  # kept until written
        log_activity(activity, seconds, len(self._in_flight))

    # ---- shutdown ------------------------------------------------------------------------------

    def _shutdown(self) -> Exit:
        """Messages still running are left to their ack wait; the others are given back."""
        self._handlers.stop()
        self._handlers.close_decided()
        try:
            self._settle()
            # Told already (a Task whose task_finished receivers outlast the grace): recorded
            # as told, not left to be delivered again
            for delivery in list(self._in_flight.values()):
                if (decided := timeouts.decided_of(delivery.job)) is not None:
                    self._finished(delivery.job, decided)
            self._settle()
            self._acks.give_back_unstarted()
        except Exception as error:
            quietly(logger.warning, "worker %s: could not settle every message at shutdown: %s",
                    self.id, error)  # fmt: skip
        while self._acks.unanswered and time.monotonic() < self._deadline:  # what the grace allows
            self._wake.wait(0.1)
            self._acks.send()
        self._acks.give_up()
        if self._in_flight:
            quietly(
                logger.warning,
                "worker %s: %d jobs still running are delivered again after their ack wait",
                self.id, len(self._in_flight),
            )  # fmt: skip
        reporter = next(chore for chore in self._chores if isinstance(chore, Reporter))
        if not reporter.last(self.db, self.id):
            log_activity(self.activity, reporter.span(), len(self._in_flight))
        self.bridge.close()
        self._announcer.stop(within=policy.grace_left(self.options.grace, self._deadline))
        self._lock_waits.stop()
        connections.close_all()
        quietly(logger.info, "worker %s stopped", self.id)
        return self._exit
