"""What a worker logs: each recorded outcome worth a line, and its activity every interval."""

from __future__ import annotations

import logging

from django_pgjobs.models import Job
from django_pgjobs.observability.activity import ActivityTally
from django_pgjobs.outcomes import Handled, Outcome, Verdict

logger = logging.getLogger("django_pgjobs.runtime.worker")


def log_outcome(job: Job, handled: Handled, outcome: Outcome) -> None:
    """A line for a failed, dead-lettered or cancelled attempt (successes at DEBUG), with the
    job's fields as extras for structured log handlers."""
    extra = {
        "job_id": str(job.pk),
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempts,
        "duration": round(handled.duration, 6),
    }
    if outcome is Outcome.SUCCEEDED:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("job %s (%s) succeeded", job.pk, job.task, extra=extra)
        return
    if handled.verdict is not Verdict.ERROR or outcome is Outcome.LOST:
        return
    assert handled.failure is not None
    extra |= {"error": handled.failure.summary, "status": outcome.value}
    if outcome is Outcome.CANCELLED:
        logger.info("job %s (%s) cancelled", job.pk, job.task, extra=extra)
        return
    dead = outcome is Outcome.FAILED
    (logger.error if dead else logger.info)(
        "job %s (%s) attempt %d failed: %s%s", job.pk, job.task, job.attempts,
        handled.failure.summary, "; dead-lettered" if dead else "", extra=extra,
    )  # fmt: skip


def log_activity(activity: ActivityTally, seconds: float, in_flight: int) -> None:
    """One line of what the worker did over the last `seconds`."""
    if activity.queues or in_flight:
        done, dead = activity.total(Outcome.SUCCEEDED), activity.total(Outcome.FAILED)
        logger.info(
            "last %.0fs: done=%d retried=%d dead=%d cancelled=%d lost=%d in_flight=%d "
            "(%.0f jobs/s)", seconds, done, activity.total(Outcome.RETRIED), dead,
            activity.total(Outcome.CANCELLED), activity.total(Outcome.LOST), in_flight,
            (done + dead) / seconds,
        )  # fmt: skip
