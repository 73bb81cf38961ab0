"""What a worker logs: each recorded outcome worth a line, and its activity every interval."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from django_pgjobs.models import Job
from django_pgjobs.observability.activity import ActivityTally
from django_pgjobs.outcomes import Handled, Outcome, Verdict

logger = logging.getLogger("django_pgjobs.runtime.worker")


def quietly(log: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """`log(*args, **kwargs)` (a logger's method), whatever the application's logging does with
    it. Python's logging calls filters outside its own guard, so a filter that raises (one that
    reads `record.request`, say, on a record that has none) raises in the thread that logs: a
    line about a job, or about an error being handled, must not stop a worker's loop or end one
    of its threads. The line is lost; the application's filter is what drops it. SystemExit too
    (a filter that calls sys.exit): a worker stops when it is told to, not from a log line."""
    with contextlib.suppress(Exception, SystemExit):
        log(*args, **kwargs)


def log_outcome(job: Job, handled: Handled, outcome: Outcome) -> None:
    """A line for a failed, dead-lettered or cancelled attempt (successes at DEBUG), with the
    job's fields as extras for structured log handlers; never raises (see `quietly`)."""
    # Nothing is built for an outcome that logs no line (a success above DEBUG, the common
    # case): the extras alone cost more than the rest of settling a no-op job.
    if outcome is Outcome.SUCCEEDED:
        if logger.isEnabledFor(logging.DEBUG):
            extra = _extra(job, handled)
            quietly(logger.debug, "job %s (%s) succeeded", job.pk, job.task, extra=extra)
        return
    if outcome is Outcome.LOST:
        quietly(
            logger.warning,
            "job %s (%s): its outcome (%s) was not recorded: the worker no longer held its claim "
            "(its lease ran out, the process stalled or the database was out of reach; another "
            "worker may have run it again)",
            job.pk, job.task, handled.verdict.value, extra=_extra(job, handled),
        )  # fmt: skip
        return
    if handled.verdict is not Verdict.ERROR:
        return
    assert handled.failure is not None
    extra = _extra(job, handled) | {"error": handled.failure.summary, "status": outcome.value}
    if outcome is Outcome.CANCELLED:
        quietly(logger.info, "job %s (%s) cancelled", job.pk, job.task, extra=extra)
        return
    dead = outcome is Outcome.FAILED
    quietly(
        logger.error if dead else logger.info,
        "job %s (%s) attempt %d failed: %s%s", job.pk, job.task, job.attempts,
        handled.failure.summary, "; dead-lettered" if dead else "", extra=extra,
    )  # fmt: skip


def _extra(job: Job, handled: Handled) -> dict[str, object]:
    return {
        "job_id": str(job.pk),
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempts,
        "duration": round(handled.duration, 6),
    }


#: A rate over less time than this says little (a --once run of a few jobs): none is shown.
MIN_RATE_SECONDS = 1.0


def log_activity(activity: ActivityTally, seconds: float, in_flight: int) -> None:
    """One line of what the worker did over the last `seconds`."""
    if activity.queues or in_flight:
        done, dead = activity.total(Outcome.SUCCEEDED), activity.total(Outcome.FAILED)
        quietly(
            logger.info,
            "last %s: done=%d retried=%d dead=%d cancelled=%d lost=%d in_flight=%d%s",
            _span(seconds), done, activity.total(Outcome.RETRIED), dead,
            activity.total(Outcome.CANCELLED), activity.total(Outcome.LOST), in_flight,
            rate(done + dead, seconds),
        )  # fmt: skip


def rate(jobs: int, seconds: float) -> str:
    """ " (231 jobs/s)", " (0.3 jobs/s)": two significant digits below 10 a second, so that
    3 jobs in 10 s do not read as 0; nothing for a span under MIN_RATE_SECONDS or no jobs."""
    if seconds < MIN_RATE_SECONDS or not jobs:
        return ""
    per_second = jobs / seconds
    shown = f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.2g}"
    return f" ({shown} jobs/s)"


def _span(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
