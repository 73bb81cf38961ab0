"""What a NATS worker tells the server about one finished attempt, and the Outcome it records:
the one place where a Handled (runtime/execute.py) becomes an ack, a nak or a term."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import NamedTuple

from django.utils import timezone

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
    NatsWorker._nak_limit) is not a NAK: the job is handed back to PostgreSQL, an outbox row
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
