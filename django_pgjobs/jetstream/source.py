"""Jobs from NATS JetStream: a worker's source for queues carried by a stream (runjobs --queue
<a NATS queue>), run by the same loop, handler threads and handlers as PostgreSQL queues.

How an attempt ends becomes the message's answer (jetstream/deliveries.py, `answer`):
succeeded, acknowledged; Retry, negatively acknowledged with its delay; an error, written back
by the worker's own rule (attempts left: a NAK with the backoff; else a dead letter written to
PostgreSQL and the message terminated). A job's attempts are its deliveries, so a message
delivered more often than its job's max_attempts without an outcome (its workers died) is
dead-lettered without running again, as the reaper does; one it acknowledged or terminated
before, delivered again, is answered the same way without running (deliveries.FinalAnswers).

Every acknowledgement is a request the server confirms, sent only while the delivery is still
the worker's (Delivery.ours); one not confirmed is sent again until then, and said in the log if
it never was. While a handler runs, its message gets an in-progress acknowledgement every third
of the ack wait, on a thread of its own: the lease is the consumer's ack wait. A message taken
and never started goes back without spending an attempt: a copy counting the attempts it
counted is published, then the delivery acknowledged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.js.errors import NotFoundError

from django_pgjobs.data.records import Claim, Failure
from django_pgjobs.jetstream import messages
from django_pgjobs.jetstream.bridge import Bridge, Sent
from django_pgjobs.jetstream.deliveries import (
    Delivery,
    DeliveryCounts,
    FinalAnswers,
    Reply,
    answer,
    nak_limit,
)
from django_pgjobs.jetstream.relay import relay_chore, start_relay
from django_pgjobs.jetstream.streams import Consumers
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.runtime.sources import Exchange, Recorded, Seat
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.transports import NatsQueue, nats_queues, nats_servers

logger = logging.getLogger(__name__)

#: Seconds a fetch waits for messages while handlers run (their outcomes wait for it).
BUSY_FETCH = 0.05

#: The most of the ack wait an idle fetch waits for messages: what came last still has most of
#: its fence (2/3 of the ack wait) to run in.
FETCH_SHARE = 0.25

#: The longest a worker goes without reading its consumers as the server has them (another
#: worker may have shortened their ack wait; one may be gone) and acknowledging its running
#: messages as in progress.
ACK_WAIT_CHECK = 1.0

#: How often answers the server has not confirmed yet are sent again.
RESEND_EVERY = 0.1


class NatsSource:
    """A worker's jobs from the durable consumers of `queues`' streams."""

    queues_are = "NATS queues"
    #: Its claims are fetches from NATS: they take nothing from the job database.
    yields = False

    def __init__(self, queues: Sequence[NatsQueue], bridge: Bridge) -> None:
        self.queues, self.bridge = list(queues), bridge
        self._queues = {queue.queue: queue for queue in self.queues}
        self.chores: list[Chore] = []
        self._lock = threading.Lock()  # guards _deliveries against the in-progress thread
        self._deliveries: dict[int, Delivery] = {}  # by claim (the Job object)
        self._recorded: list[Recorded] = []  # answers confirmed since the last exchange
        self._arrived_lost: list[tuple[Job, Handled]] = []  # delivered past max_attempts
        self._delivery_counts = DeliveryCounts()
        self._final_answers = FinalAnswers()  # what it acknowledged or terminated, by message
        self._said_answered_again = False  # said at INFO once, then at DEBUG
        self.unanswered: list[Delivery] = []  # decided, not confirmed (the main thread's)
        # Held by whoever sends acknowledgements: an in-progress one sent after a NAK would
        # undo the NAK's delay.
        self._sending = threading.Lock()

    def attach(self, seat: Seat) -> None:
        self.seat, self.id = seat, seat.id
        self.jobs = Job.objects.db_manager(seat.db)
        self.ack_wait = seat.lease  # the shortest of its consumers' ack waits, as last read
        self._consumers = Consumers(
            seat.id, self.bridge, self.queues, seat.lease, seat.db, seat.stopping
        )
        # Its own sessions as a PostgreSQL worker's, durable: a job written back (a retry
        # handed to PostgreSQL, a dead letter) must outlive a crash of the server once its
        # message is acknowledged.
        self._lock_waits = locks.LockWaits(seat.db, locks.application_name(seat.id), durable=True)

    def start(self) -> None:
        self._lock_waits.limit_this_thread()
        keeper = threading.Thread(
            target=self._keep_in_progress, name="pgjobs-nats-acks", daemon=True
        )
        keeper.start()

    def can_claim(self) -> bool:
        return True

    def deliveries(self) -> list[Delivery]:
        """The messages it holds, their answers decided or not."""
        with self._lock:
            return list(self._deliveries.values())

    def renew(self, jobs: list[Job]) -> None:
        """Nothing to do: a NATS lease is its consumer's ack wait, held by the in-progress
        acknowledgements."""

    def due_in(self) -> float:
        if self._recorded or self._arrived_lost:
            return 0.0
        return RESEND_EVERY if self.unanswered else float("inf")

    def failed(self, error: Exception) -> None:
        if isinstance(error, NotFoundError | ConnectionClosedError):
            self._consumers.forget()  # a consumer gone, or the connection: made again

    # ---- a turn ------------------------------------------------------------------------------

    def exchange(
        self, finished: list[tuple[Job, Handled]], wanted: int, wait: float, turn: Exchange
    ) -> None:
        finished += self._arrived_lost
        self._arrived_lost = []
        try:
            self._settle(finished)
        finally:
            turn.recorded += self._recorded
            self._recorded = []
        if wanted:
            turn.claimed += self._fetch(wanted, wait, turn)

    def _settle(self, finished: list[tuple[Job, Handled]]) -> None:
        """Turn finished attempts into acknowledgements (and dead letters), and send those
        not confirmed yet. An attempt whose delivery is no longer the worker's is not
        answered: another delivery decides its job's outcome. What raises (the database) is
        left in `finished`, answered at a later turn."""
        try:
            while finished:
                job, handled = finished[0]
                delivery = self._deliveries[id(job)]
                if delivery.ours(self.ack_wait):
                    limit = nak_limit(
                        delivery.msg.metadata.timestamp,
                        self.ack_wait,
                        self._queues[job.queue].max_age,
                    )
                    redelivered = delivery.count > 1
                    reply, delay, outcome = answer(self.jobs, job, handled, limit, redelivered)
                    delivery.decide(reply, delay, handled, outcome)
                    self._final_answers.record(delivery.msg, reply)
                    self.unanswered.append(delivery)
                else:
                    self._not_acknowledged(delivery, handled)
                finished.pop(0)
        finally:
            self._send()

    def _fetch(self, wanted: int, wait: float, turn: Exchange) -> list[Job]:
        """Take up to `wanted` messages from each served queue in turn (paused ones aside),
        waiting up to `wait` seconds when the worker has nothing else to do."""
        controls = self.seat.controls
        taking = set(controls.open) | set(controls.limited)
        subscriptions = [(queue, self._consumers.subscription(queue)) for queue in self.queues]
        taken: list[Job] = []
        asked = False
        for queue, subscription in subscriptions:
            free = wanted - len(taken)
            if free <= 0 or queue.queue not in taking:
                continue
            idle = wait > 0 and len(self.queues) == 1
            # A message's hold counts from the request (the server's ack wait may start as soon
            # as it is sent): one that came at the end of a long wait would be past its fence
            # before its handler started, and delivered again.
            timeout = max(min(wait if idle else 0.0, self.ack_wait * FETCH_SHARE), BUSY_FETCH)
            sent_at = time.monotonic()
            batch = self.bridge.fetch(
                subscription, min(free, self.seat.options.batch_size), timeout
            )
            asked = True
            taken += self._take(batch, sent_at)
        if asked:  # a fetch waits for messages itself: the next one may follow at once
            turn.poll_by = time.monotonic()
        return taken

    def _take(self, batch: list[Msg], sent_at: float) -> list[Job]:
        jobs = []
        for msg in batch:
            try:
                delivered = self._delivery_counts.of(msg)
                job = messages.job_of(msg, self.id, delivered)
            except Exception as error:  # malformed, of another shape, nested too deep, ...
                # Not a message of ours (published by hand, or by a newer release): it would
                # come back forever, so it is terminated and said once.
                log_safely(logger.error, "worker %s: terminated a message it cannot read (%s: %s)",
                        self.id, type(error).__name__, error)  # fmt: skip
                self.bridge.settle([], [], [msg])
                continue
            if (final := self._final_answers.of(msg)) is not None:
                self._answer_again(job, msg, final)
                continue
            with self._lock:
                self._deliveries[id(job)] = Delivery(job, msg, held_at=sent_at, count=delivered)
            if job.attempts > job.max_attempts:
                # Delivered again and again without an outcome: its workers died, as a job
                # whose lease expired with no attempts left (the reaper's rule).
                lost = Failure("WorkerLost", f"delivered {job.attempts} times without an outcome")
                self._arrived_lost.append(
                    (job, Handled(Verdict.ERROR, failure=lost, permanent=True))
                )
                continue
            jobs.append(job)
        return jobs

    def _answer_again(self, job: Job, msg: Msg, reply: Reply) -> None:
        """Answer a message this worker acknowledged or terminated before, delivered again,
        the same way, without running it."""
        done = "terminated" if reply is Reply.TERM else "acknowledged"
        said = "worker %s: job %s (%s) was delivered again after this worker %s its message: "
        said += "%s again, not run"
        if self._said_answered_again:
            log_safely(logger.debug, said, self.id, job.pk, job.task, done, done)
        else:
            self._said_answered_again = True
            said += (
                " (nats-server before 2.10.14 delivers terminated messages again, and an answer "
                "NATS did not confirm in time is lost with its delivery; later ones are said at "
                "DEBUG)"
            )
            log_safely(logger.info, said, self.id, job.pk, job.task, done, done)
        # Not confirmed: an answer lost here brings the message back, to be answered again.
        with contextlib.suppress(Exception):
            if reply is Reply.TERM:
                self.bridge.settle([], [], [msg])
            else:
                self.bridge.settle([msg], [], [])

    # ---- answers -------------------------------------------------------------------------------

    def _send(self) -> None:
        """Send the acknowledgements decided and not confirmed yet; keep those that may be
        sent again while their deliveries are the worker's."""
        if not self.unanswered:
            return
        pending, self.unanswered = self.unanswered, []
        for delivery in pending:
            if not delivery.ours(self.ack_wait):
                self._not_acknowledged(delivery, delivery.handled)
        sending = [delivery for delivery in pending if not delivery.lost]
        answers = [(d.msg, d.payload(), d.until(self.ack_wait)) for d in sending]
        try:
            with self._sending:
                sent = self.bridge.acknowledge(answers)
        except Exception as error:  # the connection's loop did not finish in time
            log_safely(logger.warning, "worker %s: acknowledging %d messages: %s", self.id,
                    len(answers), error)  # fmt: skip
            sent = [Sent.UNCERTAIN] * len(sending)
        for delivery, result in zip(sending, sent, strict=True):
            # A NAK is never sent twice: the first may have been processed, and its
            # redelivery have gone to another worker, whose delivery a second one would end.
            uncertain_nak = result is Sent.UNCERTAIN and delivery.reply is Reply.NAK
            if result is Sent.CONFIRMED or uncertain_nak:
                self._answered(delivery)
            else:
                self.unanswered.append(delivery)

    def _answered(self, delivery: Delivery) -> None:
        job = delivery.job
        with self._lock:
            self._deliveries.pop(id(job), None)
        if delivery.handled is not None and delivery.outcome is not None:
            self._recorded.append(Recorded(job, delivery.handled, delivery.outcome))

    def _not_acknowledged(self, delivery: Delivery, handled: Handled | None) -> None:
        """The delivery stopped being the worker's before the server confirmed its answer
        (or before it was decided): say what that means for the job, once."""
        job, reply = delivery.job, delivery.reply
        with self._lock:
            self._deliveries.pop(id(job), None)
        if handled is None and reply is Reply.NAK:
            said = "was not started, and could not be given back (NATS unreachable): its "
            said += "message is delivered again, and that delivery counts as an attempt (a "
            said += "dead letter, WorkerLost, if it had none left)"
        elif handled is None:
            said = "given back unstarted, but NATS did not confirm it: the message is also "
            said += "delivered again after its ack wait; on another worker it runs, and that "
            said += "delivery counts as an attempt (this one acknowledges it again unrun)"
        elif reply is None:
            said = f"its outcome ({handled.verdict.value}) is not acknowledged: no in-progress "
            said += "acknowledgement reached NATS within its ack wait (the worker was stopped, "
            said += "or cut off from NATS), so another worker may run it now; that run decides"
        elif reply is Reply.ACK and delivery.outcome is Outcome.RETRIED:
            said = "was handed back to PostgreSQL for its retry (an outbox row), but NATS did "
            said += "not confirm its message's acknowledgement within its ack wait: it is "
            said += "delivered again, and may run again before its retry on another worker "
            said += "(this one acknowledges it again unrun)"
        elif reply is Reply.ACK:
            said = "succeeded, but NATS did not confirm its acknowledgement within its ack "
            said += "wait: it is delivered again; this worker acknowledges it again unrun, "
            said += "another runs it again (a dead letter, WorkerLost, if it had no attempt "
            said += "left: it did succeed)"
        elif reply is Reply.NAK:
            said = "failed, and NATS did not confirm its negative acknowledgement within its "
            said += "ack wait: it is delivered again after the ack wait, not its delay"
        else:
            said = "is ended (written back to PostgreSQL), but NATS did not confirm its "
            said += "message's termination: it is delivered again; this worker terminates it "
            said += "again unrun, another runs it once more, finds it ended and terminates it"
        log_safely(logger.warning, "worker %s: job %s (%s) %s", self.id, job.pk, job.task,
                said)  # fmt: skip
        if handled is not None:
            outcome = delivery.outcome if reply in (Reply.NAK, Reply.TERM) else None
            outcome = outcome or Outcome.LOST  # LOST: said above, not in log_outcome's words
            self._recorded.append(Recorded(job, handled, outcome, outcome is Outcome.LOST))

    # ---- in progress ---------------------------------------------------------------------------

    def _keep_in_progress(self) -> None:
        """Every third of the shortest ack wait of its consumers (at most every ACK_WAIT_CHECK
        seconds, when it reads them again), an in-progress acknowledgement for each message the
        worker holds, sent while its delivery is the worker's (and not once a NAK is decided
        for it: it would undo the NAK's delay); each one the server confirms in time extends
        the worker's hold. The thread lives until the worker stops, whatever a round raises:
        without it every ack wait would run out under the handlers."""
        while True:
            time.sleep(min(self.ack_wait / 3, ACK_WAIT_CHECK))
            # Stopped with nothing running, or gone (what still runs is left to its ack wait).
            if (self.seat.stopping() and not self._deliveries) or self.bridge.closed:
                return
            with contextlib.suppress(BaseException):  # NATS away: the last one read stands
                self.ack_wait = self._consumers.read(self.ack_wait)
            try:
                self._send_in_progress()
            except BaseException as error:
                log_safely(
                    logger.warning, "could not extend the ack wait of running jobs: %s", error
                )

    def _send_in_progress(self) -> None:
        ack_wait = self.ack_wait
        with self._sending:
            with self._lock:
                holding = [
                    delivery
                    for delivery in self._deliveries.values()
                    if delivery.reply is not Reply.NAK and delivery.ours(ack_wait)
                ]
            if not holding:
                return
            sent_at = time.monotonic()
            confirmed = self.bridge.in_progress([(d.msg, d.until(ack_wait)) for d in holding])
        for delivery, confirmed_at in zip(holding, confirmed, strict=True):
            if confirmed_at is not None:
                delivery.extended(sent_at, confirmed_at, ack_wait)

    # ---- giving back ---------------------------------------------------------------------------

    def give_back(self, jobs: list[Job]) -> None:
        """Give back messages taken and never started, without spending an attempt: a copy of
        each, counting the attempts it counted, is published, and only once the stream has
        stored it is the delivery acknowledged. A worker that dies between the two leaves both:
        the job may run twice, never not at all. Stopping, what cannot be given back is
        negatively acknowledged (its next delivery then counts as an attempt)."""
        try:
            self._give_back(jobs)
        except Exception as error:
            if not self.seat.stopping():
                raise
            log_safely(
                logger.warning,
                "worker %s: could not give back %d unstarted messages (%s): they are delivered "
                "again, each counting as an attempt", self.id, len(jobs), error,
            )  # fmt: skip
            for job in jobs:
                if (delivery := self._deliveries.get(id(job))) and not delivery.reply:
                    delivery.decide(Reply.NAK)
                    self.unanswered.append(delivery)
            self._send()

    def _give_back(self, jobs: list[Job]) -> None:
        deliveries = [self._deliveries[id(job)] for job in jobs]
        ours = [delivery for delivery in deliveries if delivery.ours(self.ack_wait)]
        with self._lock:
            for delivery in deliveries:
                if delivery.lost:
                    self._deliveries.pop(id(delivery.job), None)
        if not ours:
            return
        self.bridge.publish([messages.given_back(d.job, d.msg) for d in ours])
        for delivery in ours:
            delivery.decide(Reply.ACK)
            self._final_answers.record(delivery.msg, Reply.ACK)  # its copy carries the job
            self.unanswered.append(delivery)
        self._send()

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self, left: list[Claim]) -> tuple[list[Recorded], bool]:
        """Answers not confirmed yet are sent again within what the grace allows; messages
        still running are left to their ack wait."""
        while self.unanswered and time.monotonic() < self.seat.deadline():
            time.sleep(RESEND_EVERY)
            self._send()
        for delivery in self.unanswered:  # each answer never confirmed is said
            self._not_acknowledged(delivery, delivery.handled)
        self.unanswered = []
        if self._deliveries:
            log_safely(
                logger.warning,
                "worker %s: %d jobs still running are delivered again after their ack wait",
                self.id, len(self._deliveries),
            )  # fmt: skip
        recorded, self._recorded = self._recorded, []
        return recorded, True

    def close(self) -> None:
        self.bridge.close()
        self._lock_waits.stop()


class MixedQueues(ValueError):
    """NATS queues and PostgreSQL queues given to one worker."""


def worker(options: Options) -> Worker:
    """The worker for `options.queues`: with a NATS source when they all use NATS, PostgreSQL
    when none does (MixedQueues otherwise); with the relay of every NATS queue when
    options.relay."""
    queues = nats_queues()
    ours = [queues[name] for name in options.queues if name in queues]
    if ours and len(ours) != len(options.queues):
        others = [name for name in options.queues if name not in queues]
        raise MixedQueues(
            f"the queues {', '.join(q.queue for q in ours)} use NATS and "
            f"{', '.join(others)} PostgreSQL: run one runjobs for each kind"
        )
    bridge = Bridge(nats_servers())
    chores: list[Chore] = []
    if options.relay and options.once:
        chores.append(relay_chore(bridge))
    elif options.relay:
        start_relay(relay_chore(bridge).relay)
    if ours:
        return Worker(options, NatsSource(ours, bridge), chores)
    return Worker(options, chores=chores)
