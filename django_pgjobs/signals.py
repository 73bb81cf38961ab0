"""Job lifecycle signals. Receivers run in the worker process, so keep them quick and never let
them raise: an exception in a receiver is logged, never propagated (``send_robust``).

Every signal is sent with ``sender=Job`` (the model class) and ``job=<Job>``, except
``job_enqueued``, which is sent once per enqueue call with ``jobs=[...]``.

- ``job_enqueued(jobs)``: after the INSERT (inside the caller's transaction: it may still roll
  back; use ``transaction.on_commit`` in the receiver to act only on committed jobs).
- ``job_started(job)``: in the handler's thread, just before the handler is called.
- ``job_succeeded(job, duration)``: the success was recorded.
- ``job_retried(job, duration, error, delay)``: the attempt failed (``error`` is a
  ``Failure``) or asked to ``Retry`` (``error`` is None); the job is ready again later.
- ``job_failed(job, duration, error)``: the job is a dead letter now.
- ``job_cancelled(job, duration)``: a cancellation requested while the job ran was recorded.

``duration`` is the handler's wall time in seconds; ``job.attempts`` counts this attempt.
Outcomes a worker could not record because it had lost the job's lease send nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal

if TYPE_CHECKING:
    from django_pgjobs.manager import Failure
    from django_pgjobs.models import Job

logger = logging.getLogger(__name__)

job_enqueued = Signal()
job_started = Signal()
job_succeeded = Signal()
job_retried = Signal()
job_failed = Signal()
job_cancelled = Signal()


def send(signal: Signal, **kwargs: Any) -> None:
    """Send `signal` with sender=Job; a receiver's exception is logged, never raised."""
    if not signal.receivers:
        return
    from django_pgjobs.models import Job

    for receiver, response in signal.send_robust(sender=Job, **kwargs):
        if isinstance(response, Exception):
            logger.error("signal receiver %r raised", receiver, exc_info=response)


#: The outcome an attempt had, by the status it left the job in.
OUTCOME_OF_STATUS = {
    "succeeded": "succeeded",
    "ready": "retried",
    "failed": "failed",
    "cancelled": "cancelled",
}
#: The signal of each outcome ("lost" has none).
SIGNAL_OF_OUTCOME = {
    "succeeded": job_succeeded,
    "retried": job_retried,
    "failed": job_failed,
    "cancelled": job_cancelled,
}


def announce(
    job: Job,
    outcome: str,
    *,
    duration: float,
    error: Failure | None = None,
    delay: float | None = None,
) -> None:
    """Send the signal of an attempt's recorded `outcome` (succeeded, retried, failed,
    cancelled; "lost" sends nothing): the worker and ``testing.run_jobs`` both use it."""
    signal = SIGNAL_OF_OUTCOME.get(outcome)
    if signal is None or not signal.receivers:
        return
    arguments: dict[str, Any] = {"job": job, "duration": duration}
    if signal is job_retried:
        arguments |= {"error": error, "delay": delay}
    elif signal is job_failed:
        arguments["error"] = error
    send(signal, **arguments)
