"""One message as a NATS worker holds it, and what it answers the server about a finished attempt.

JetStream acts on an acknowledgement sent on any delivery's reply subject while it holds the
message unacknowledged, a later delivery's too: a worker whose ack wait ran out and whose message
went to another worker meanwhile would, with a NAK, have it delivered a third time while the
other still runs it. The server says nothing of which delivery is current, so the worker keeps a
fence of its own, as a lease: the server holds a delivery at least `ack_wait` seconds from when
the worker sent the last in-progress acknowledgement it confirmed (or the pull request that
brought it). Until FENCE of that has passed the delivery is the worker's; after, it is lost for
good, and the worker sends nothing more for it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import NamedTuple

from django.utils import timezone
from nats.aio.msg import Msg

from django_pgjobs.data.jobs import IN_OUTBOX, WRITTEN, JobManager
from django_pgjobs.data.records import Failure
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.status import Status

#: Seconds before a message whose job still sits in the outbox is delivered again.
OUTBOX_DELAY = 1.0


class Reply(Enum):
    ACK = "ack"  # done with: the stream's retention decides how long it stays
    NAK = "nak"  # deliver again after the delay
    TERM = "term"  # never deliver again to this consumer


class Answer(NamedTuple):
    reply: Reply
    delay: float
    outcome: Outcome


#: The longest delay a NAK carries: JetStream takes it in nanoseconds, in 64 bits (292 years);
#: one longer, though a delay pgjobs accepts (up to 1000 years), came back at once, again and
#: again.
MAX_NAK_DELAY = 100 * 365 * 86400.0


#: How many ack waits a NAK's delay may last: a message waiting out its delay holds one of
#: the consumer's max ack pending (the queue's max_running) all along, as a running job does.
NAK_ACK_WAITS = 3


def nak_limit(published_at: datetime, ack_wait: float, max_age: float) -> float:
    """The longest delay a NAK of a message stored at `published_at` may carry: NAK_ACK_WAITS
    ack waits, and less than what its stream's `max_age` (0: none) leaves it, by an ack wait
    (a message that expires while it waits is gone without a word)."""
    limit = NAK_ACK_WAITS * ack_wait
    if max_age:
        left = max_age - (timezone.now() - published_at).total_seconds()
        limit = min(limit, left - ack_wait)
    return max(limit, 0.0)


def answer(
    jobs: JobManager, job: Job, handled: Handled, nak_limit: float, redelivered: bool = False
) -> Answer:
    """Success acks; Retry naks with its delay; an error is recorded by the worker's own rule
    (JobManager.write_back): attempts left nak with the backoff, a dead letter terms. A delay
    over `nak_limit` (the longest the message may wait out in the stream: see
    nak_limit) is not a NAK: the job is handed back to PostgreSQL, an outbox row
    due after the delay, and the message acked. A success of a message delivered again
    (`redelivered`) also deletes such a row that an earlier delivery of it wrote before its
    acknowledgement was lost: else the job ran once more at its retry. May raise
    DatabaseError (the attempt is then answered later)."""
    if handled.verdict is Verdict.SUCCEEDED:
        if redelivered:
            jobs.drop_superseded(job, below=job.claims + 1)
        return Answer(Reply.ACK, 0.0, Outcome.SUCCEEDED)
    if handled.verdict is Verdict.RETRY and job.attempts >= job.max_attempts:
        # A Retry is a delivery, so an attempt: on the last one it is the job's end, said so
        # now (delivered again, it would be dead-lettered unrun as a lost worker's).
        handled = Handled(Verdict.ERROR, failure=Failure(
            "django_pgjobs.RetryExhausted",
            f"asked to run again (Retry) on its last attempt ({job.attempts} of "
            f"{job.max_attempts}); on a NATS queue each Retry is an attempt",
        ), permanent=True, duration=handled.duration)  # fmt: skip
    handing_back = handled.delay > nak_limit
    if handled.verdict is Verdict.RETRY:
        if not handing_back:
            return Answer(Reply.NAK, min(handled.delay, MAX_NAK_DELAY), Outcome.RETRIED)
        status = jobs.hand_back(job, handled.delay)
    else:
        assert handled.failure is not None
        status = jobs.write_back(
            job, handled.failure, permanent=handled.permanent, delay=handled.delay,
            hand_back=handing_back,
        )  # fmt: skip
    if status == Status.READY and handing_back:  # its outbox row carries the retry
        return Answer(Reply.ACK, 0.0, Outcome.RETRIED)
    if status == Status.READY:
        return Answer(Reply.NAK, min(handled.delay, MAX_NAK_DELAY), Outcome.RETRIED)
    if status == IN_OUTBOX:  # its relay has not committed yet: after that, this is recorded
        return Answer(Reply.NAK, OUTBOX_DELAY, Outcome.LOST)
    if status == WRITTEN:  # an earlier delivery wrote it, or it was replayed since
        return Answer(Reply.TERM, 0.0, Outcome.LOST)
    return Answer(Reply.TERM, 0.0, Outcome.of_status(status))


#: The share of the ack wait after the last confirmed hold within which the worker still
#: answers: the rest is left for the answer's way to the server. In-progress acknowledgements
#: come every third of the ack wait, so a worker that runs and reaches NATS never gets near it.
FENCE = 2 / 3


@dataclass(eq=False)
class Delivery:
    """A fetched message, its job, and what the worker decided to answer (not yet confirmed)."""

    job: Job
    msg: Msg
    #: Monotonic: when the worker sent the last request the server confirmed holding it for
    #: (the fetch, then each in-progress acknowledgement).
    held_at: float
    #: Which delivery of the message this is (DeliveryCounts).
    count: int = 1
    lost: bool = False
    reply: Reply | None = None
    delay: float = 0.0
    #: The attempt's end, with its outcome; None for a message given back unstarted.
    handled: Handled | None = None
    outcome: Outcome | None = None

    def until(self, ack_wait: float) -> float:
        """Until when (monotonic) an acknowledgement of this delivery may be sent."""
        return self.held_at + ack_wait * FENCE

    def ours(self, ack_wait: float) -> bool:
        """Whether the delivery is still the worker's; once not, never again."""
        if not self.lost and time.monotonic() >= self.until(ack_wait):
            self.lost = True
        return not self.lost

    def extended(self, sent_at: float, confirmed_at: float, ack_wait: float) -> None:
        """The server confirmed an in-progress acknowledgement sent at `sent_at`: it counts
        only if the confirmation came while the delivery was the worker's (one that came later
        may have extended another worker's delivery)."""
        if not self.lost and confirmed_at < self.until(ack_wait):
            self.held_at = max(self.held_at, sent_at)

    def decide(self, reply: Reply, delay: float = 0.0, handled: Handled | None = None,
               outcome: Outcome | None = None) -> None:  # fmt: skip
        self.reply, self.delay, self.handled, self.outcome = reply, delay, handled, outcome

    def payload(self) -> bytes:
        """The acknowledgement decided, as JetStream reads it on the reply subject."""
        if self.reply is Reply.ACK:
            return b"+ACK"
        if self.reply is Reply.TERM:
            return b"+TERM"
        assert self.reply is Reply.NAK
        if self.delay <= 0:
            return b"-NAK"
        return b"-NAK " + json.dumps({"delay": int(self.delay * 10**9)}).encode()


MessageKey = tuple[str, int, str | None]


def message_key(msg: Msg) -> MessageKey:
    """A message as the worker tells messages apart: its stream, its stream sequence and its
    message id (a stream made again numbers new messages from 1)."""
    meta = msg.metadata
    return (meta.stream, meta.sequence.stream, (msg.headers or {}).get("Nats-Msg-Id"))


class DeliveryCounts:
    """The delivery count of each message, as this worker has seen it go: never backwards.

    nats-server before 2.10.14 (Debian 12 ships 2.9.10) may deliver a message it is already
    redelivering once more as a first delivery, with a count of 1, after it failed to deliver
    it to an expired pull request (nats-server#5305, #5338). The job then counted an attempt it
    had spent already: its attempts went 1, 2, 1, and at the server's next count, past its
    max_attempts, it was dead-lettered as a lost worker's ("delivered 4 times without an
    outcome") instead of running its last attempt. A count lower than one this worker saw for
    the same message (its stream, stream sequence and message id: a stream made again numbers
    new messages from 1) is taken as one more than that. Bounded: the LIMIT most recent
    messages.
    """

    LIMIT = 10_000

    def __init__(self) -> None:
        self._seen: OrderedDict[MessageKey, int] = OrderedDict()

    def of(self, msg: Msg) -> int:
        key = message_key(msg)
        count = max(msg.metadata.num_delivered, self._seen.pop(key, 0) + 1)
        self._seen[key] = count
        if len(self._seen) > self.LIMIT:
            self._seen.popitem(last=False)
        return count


class FinalAnswers:
    """The final answers (ACK, TERM) this worker decided, by message (message_key), so that a
    message delivered to it again is answered the same way without running.

    An acknowledged or terminated message should never come back, but it does: nats-server
    before 2.10.14 (Debian 12 ships 2.9.10) may deliver a terminated message again
    (nats-server#5305, #5338), and an answer the server did not confirm within the fence is
    lost with its delivery. Either way the job's end was decided (a success, a dead letter
    written to PostgreSQL, a retry handed back to it, a copy given back): running the message
    again would run the job once more. Bounded: the LIMIT most recent messages."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._answers: OrderedDict[MessageKey, Reply] = OrderedDict()

    def record(self, msg: Msg, reply: Reply) -> None:
        """Keep `reply` as `msg`'s final answer, unless it is a NAK (the message is meant to
        come back and run)."""
        if reply is Reply.NAK:
            return
        key = message_key(msg)
        self._answers.pop(key, None)
        self._answers[key] = reply
        if len(self._answers) > self.LIMIT:
            self._answers.popitem(last=False)

    def of(self, msg: Msg) -> Reply | None:
        """The final answer this worker gave `msg` (an earlier delivery of it), if any."""
        return self._answers.get(message_key(msg))
