"""What a NATS worker tells the server about one finished attempt, and the Outcome it records:
the one place where a Handled (runtime/execute.py) becomes an ack, a nak or a term."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

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
#: again. The stream's MAX_AGE ends such a message long before either.
MAX_NAK_DELAY = 100 * 365 * 86400.0


def answer(jobs: JobManager, job: Job, handled: Handled) -> Answer:
    """Success acks; Retry naks with its delay; an error is recorded by the worker's own rule
    (JobManager.write_back): attempts left nak with the backoff, a dead letter terms. May
    raise DatabaseError (the attempt is then answered later)."""
    if handled.verdict is Verdict.SUCCEEDED:
        return Answer(Reply.ACK, 0.0, Outcome.SUCCEEDED)
    if handled.verdict is Verdict.RETRY and job.attempts >= job.max_attempts:
        # A Retry is a delivery, so an attempt: on the last one it is the job's end, said so
        # now (delivered again, it would be dead-lettered unrun as a lost worker's).
        handled = Handled(Verdict.ERROR, failure=Failure(
            "django_pgjobs.RetryExhausted",
            f"asked to run again (Retry) on its last attempt ({job.attempts} of "
            f"{job.max_attempts}); on a NATS queue each Retry is an attempt",
        ), permanent=True, duration=handled.duration)  # fmt: skip
    if handled.verdict is Verdict.RETRY:
        return Answer(Reply.NAK, min(handled.delay, MAX_NAK_DELAY), Outcome.RETRIED)
    assert handled.failure is not None
    status = jobs.write_back(job, handled.failure, permanent=handled.permanent, delay=handled.delay)
    if status == Status.READY:
        return Answer(Reply.NAK, min(handled.delay, MAX_NAK_DELAY), Outcome.RETRIED)
    if status == IN_OUTBOX:  # its relay has not committed yet: after that, this is recorded
        return Answer(Reply.NAK, OUTBOX_DELAY, Outcome.LOST)
    if status == WRITTEN:  # an earlier delivery wrote it, or it was replayed since
        return Answer(Reply.TERM, 0.0, Outcome.LOST)
    return Answer(Reply.TERM, 0.0, Outcome.of_status(status))
