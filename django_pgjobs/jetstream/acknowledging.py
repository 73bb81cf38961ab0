"""What a NATS worker tells the server about the messages it holds: the answers it decided,
sent until the server confirms them; in-progress acknowledgements while handlers run; messages
fetched and never started, given back; and a warning for each answer never confirmed.

Every acknowledgement is a request the server confirms, sent only while the delivery is still
the worker's (jetstream/deliveries.py); one not confirmed is sent again until then, and said in
the log if it never was. While a handler runs, its message gets an in-progress acknowledgement
every lease/3 on a thread of its own: the lease is the consumer's ack wait.

A message fetched and never started (the worker stops, or every handler thread is held up by
a long job) goes back without spending an attempt: a copy counting the attempts it counted is
published, then the delivery acknowledged (Acknowledger._give_back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from django_pgjobs.jetstream import messages
from django_pgjobs.jetstream.answers import Reply
from django_pgjobs.jetstream.bridge import Bridge, Sent
from django_pgjobs.jetstream.deliveries import Delivery
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome
from django_pgjobs.runtime.handlers import HandlerPool
from django_pgjobs.runtime.reporting import quietly

logger = logging.getLogger(__name__)

#: The longest a worker goes without reading its consumers as the server has them (another
#: worker may have shortened their ack wait; one may be gone) and acknowledging its running
#: messages as in progress.
ACK_WAIT_CHECK = 1.0

#: An attempt's end recorded by the worker (NatsWorker._settled): job, how it ended, its
#: Outcome, and whether its log line was said already.
Settled = Callable[[Job, Handled, Outcome, bool], None]


class Acknowledger:
    """A NATS worker's acknowledgements. It shares the worker's deliveries in flight (by
    claim) and the lock that guards them; `settled` records an attempt whose answer is done
    with. Its methods run on the worker's main thread, keep_in_progress on a thread of its
    own."""

    def __init__(
        self,
        worker: str,
        bridge: Bridge,
        lease: float,
        in_flight: dict[int, Delivery],
        lock: threading.Lock,
        handlers: HandlerPool,
        stopping: Callable[[], bool],
        settled: Settled,
    ) -> None:
        self.worker, self.bridge = worker, bridge
        self._in_flight, self._lock = in_flight, lock
        self._handlers, self._stopping, self._settled = handlers, stopping, settled
        self.unanswered: list[Delivery] = []  # decided, not confirmed (the main thread's)
        # Held by whoever sends acknowledgements: an in-progress one sent after a NAK would
        # undo the NAK's delay.
        self._sending = threading.Lock()
        self.ack_wait = lease  # the shortest of its consumers' ack waits, as last read

    # ---- answers -------------------------------------------------------------------------------

    def send(self) -> None:
        """Send the acknowledgements decided and not confirmed yet; keep those that may be
        sent again while their deliveries are the worker's."""
        if not self.unanswered:
            return
        pending, self.unanswered = self.unanswered, []
        for delivery in pending:
            if not delivery.ours(self.ack_wait):
                self.not_acknowledged(delivery, delivery.handled)
        sending = [delivery for delivery in pending if not delivery.lost]
        answers = [(d.msg, d.payload(), d.until(self.ack_wait)) for d in sending]
        try:
            with self._sending:
                sent = self.bridge.acknowledge(answers)
        except Exception as error:  # the connection's loop did not finish in time
            quietly(logger.warning, "worker %s: acknowledging %d messages: %s", self.worker,
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
            self._in_flight.pop(id(job), None)
        if delivery.handled is not None and delivery.outcome is not None:
            self._settled(job, delivery.handled, delivery.outcome, False)

    def give_up(self) -> None:
        """The worker stops: each answer still not confirmed is said, and not sent again."""
        for delivery in self.unanswered:
            self.not_acknowledged(delivery, delivery.handled)
        self.unanswered = []

    def not_acknowledged(self, delivery: Delivery, handled: Handled | None) -> None:
        """The delivery stopped being the worker's before the server confirmed its answer
        (or before it was decided): say what that means for the job, once."""
        job, reply = delivery.job, delivery.reply
        with self._lock:
            self._in_flight.pop(id(job), None)
        if handled is None and reply is Reply.NAK:
            said = "was not started, and could not be given back (NATS unreachable): its "
            said += "message is delivered again, and that delivery counts as an attempt (a "
            said += "dead letter, WorkerLost, if it had none left)"
        elif handled is None:
            said = "given back unstarted, but NATS did not confirm it: the message is also "
            said += "delivered again after its ack wait, and that delivery counts as an attempt"
        elif reply is None:
            said = f"its outcome ({handled.verdict.value}) is not acknowledged: no in-progress "
            said += "acknowledgement reached NATS within its ack wait (the worker was stopped, "
            said += "or cut off from NATS), so another worker may run it now; that run decides"
        elif reply is Reply.ACK and delivery.outcome is Outcome.RETRIED:
            said = "was handed back to PostgreSQL for its retry (an outbox row), but NATS did "
            said += "not confirm its message's acknowledgement within its ack wait: it is "
            said += "delivered again, and may run again before its retry"
        elif reply is Reply.ACK:
            said = "succeeded, but NATS did not confirm its acknowledgement within its ack "
            said += "wait: it is delivered again, and run again (a dead letter, WorkerLost, if "
            said += "it had no attempt left: it did succeed)"
        elif reply is Reply.NAK:
            said = "failed, and NATS did not confirm its negative acknowledgement within its "
            said += "ack wait: it is delivered again after the ack wait, not its delay"
        else:
            said = "is ended (written back to PostgreSQL), but NATS did not confirm its "
            said += "message's termination: its next delivery finds it ended and is terminated"
        quietly(logger.warning, "worker %s: job %s (%s) %s", self.worker, job.pk, job.task,
                said)  # fmt: skip
        if handled is not None:
            outcome = delivery.outcome if reply in (Reply.NAK, Reply.TERM) else None
            outcome = outcome or Outcome.LOST  # LOST: said above, not in log_outcome's words
            self._settled(job, handled, outcome, outcome is Outcome.LOST)

    # ---- in progress ---------------------------------------------------------------------------

    def keep_in_progress(self, read_consumers: Callable[[float], float]) -> None:
        """Every third of the shortest ack wait of its consumers (at most every ACK_WAIT_CHECK
        seconds, when `read_consumers` reads them again), an in-progress acknowledgement for
        each message the worker holds, sent while its delivery is the worker's (and not once a
        NAK is decided for it: it would undo the NAK's delay); each one the server confirms in
        time extends the worker's hold.
        The thread lives until the worker stops, whatever a round raises or its logging does
        (runtime/logs.py, quietly): without it every ack wait would run out under the handlers,
        and their messages would be delivered again."""
        while True:
            time.sleep(min(self.ack_wait / 3, ACK_WAIT_CHECK))
            # Stopped with nothing running, or gone (what still runs is left to its ack wait).
            if (self._stopping() and not self._in_flight) or self.bridge.closed:
                return
            with contextlib.suppress(BaseException):  # NATS away: the last one read stands
                self.ack_wait = read_consumers(self.ack_wait)
            try:
                self._hold()
            except BaseException as error:
                quietly(logger.warning, "could not extend the ack wait of running jobs: %s", error)

    def _hold(self) -> None:
        ack_wait = self.ack_wait
        with self._sending:
            with self._lock:
                holding = [
                    delivery
                    for delivery in self._in_flight.values()
                    if delivery.reply is not Reply.NAK and delivery.ours(ack_wait)
                ]
            if not holding:
                return
            sent_at = time.monotonic()
            confirmed = self.bridge.in_progress([(d.msg, d.until(ack_wait)) for d in holding])
        for delivery, confirmed_at in zip(holding, confirmed, strict=True):
            if confirmed_at is not None:
                delivery.held(sent_at, confirmed_at, ack_wait)

    # ---- giving back ---------------------------------------------------------------------------

    def give_back_unstarted(self) -> int:
        """Give back the messages no handler thread has started; returns how many. Those that
        cannot be given back now stay, to be started (or, stopping, negatively acknowledged:
        their next delivery then counts as an attempt)."""
        unstarted = self._handlers.unstarted()
        if not unstarted:
            return 0
        try:
            return self._give_back(unstarted)
        except Exception as error:
            if not self._stopping():
                for job in unstarted:  # in the order they came
                    self._handlers.submit(job)
                raise
            quietly(
                logger.warning,
                "worker %s: could not give back %d unstarted messages (%s): they are delivered "
                "again, each counting as an attempt", self.worker, len(unstarted), error,
            )  # fmt: skip
            for job in unstarted:
                if (delivery := self._in_flight.get(id(job))) and not delivery.reply:
                    delivery.decide(Reply.NAK)
                    self.unanswered.append(delivery)
            self.send()
            return 0

    def _give_back(self, jobs: list[Job]) -> int:
        """Give back messages fetched and never started, without spending an attempt: a copy
        of each, counting the attempts it counted (messages.given_back), is published, and
        only once the stream has stored it is the delivery acknowledged. A worker that dies
        between the two leaves both: the delivery comes back after its ack wait (counting an
        attempt, as before this), the copy is delivered too, and the job may run twice, never
        not at all. A delivery no longer the worker's is left to the one that replaced it.
        Returns how many went back; raises what publishing raises (nothing given back then)."""
        deliveries = [self._in_flight[id(job)] for job in jobs]
        ours = [delivery for delivery in deliveries if delivery.ours(self.ack_wait)]
        with self._lock:
            for delivery in deliveries:
                if delivery.lost:
                    self._in_flight.pop(id(delivery.job), None)
        if not ours:
            return 0
        self.bridge.publish([messages.given_back(d.job, d.msg) for d in ours])
        for delivery in ours:
            delivery.decide(Reply.ACK)
            self.unanswered.append(delivery)
        self.send()
        return len(ours)
