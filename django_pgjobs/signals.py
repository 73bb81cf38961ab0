"""Job lifecycle signals. Receivers run in the worker process, so keep them quick: an exception
in a receiver is logged, never propagated. A worker sends the outcome signals on a thread of
their own.

Every signal is sent with ``sender=Job`` (the model class) and ``job=<Job>``, except
``job_enqueued``, which is sent once per enqueue call with ``jobs=[...]``.

- ``job_enqueued(jobs)``: after the INSERT (inside the caller's transaction: it may still roll
  back; use ``transaction.on_commit`` in the receiver to act only on committed jobs).
- ``job_started(job)``: in the handler's thread, just before the handler is called.
- ``job_progress(job, done, total, note)``: in the thread that called ``progress()``, at every
  call inside a job (the database gets the report later).
- ``job_succeeded(job, duration)``: the success was recorded.
- ``job_retried(job, duration, error, delay)``: the attempt failed (``error`` is a
  ``Failure``) or asked to ``Retry`` (``error`` is None); the job is ready again later.
- ``job_failed(job, duration, error)``: the job is a dead letter now.
- ``job_cancelled(job, duration)``: a cancellation requested while the job ran was recorded.

``duration`` is the handler's wall time in seconds; ``job.attempts`` counts this attempt.
Outcomes a worker could not record because it had lost the job's lease send nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal

from django_pgjobs.outcomes import Outcome

if TYPE_CHECKING:
    from django.db.models import Model

    from django_pgjobs.data.records import Failure
    from django_pgjobs.models import Job

logger = logging.getLogger(__name__)

job_enqueued = Signal()
job_started = Signal()
job_progress = Signal()
job_succeeded = Signal()
job_retried = Signal()
job_failed = Signal()
job_cancelled = Signal()


def send(signal: Signal, sender: type[Model], **kwargs: Any) -> None:
    """Send `signal` from `sender` (the Job model); a receiver's exception is logged, never
    raised."""
    if not signal.receivers:
        return
    for receiver, response in signal.send_robust(sender=sender, **kwargs):
        if isinstance(response, Exception):
            # The application's logging may raise too (see runtime/reporting.py log_safely).
            with contextlib.suppress(Exception):
                logger.error("signal receiver %r raised", receiver, exc_info=response)


#: The signal of each recorded outcome (LOST has none).
SIGNAL_OF_OUTCOME = {
    Outcome.SUCCEEDED: job_succeeded,
    Outcome.RETRIED: job_retried,
    Outcome.FAILED: job_failed,
    Outcome.CANCELLED: job_cancelled,
}


def announce(
    job: Job,
    outcome: Outcome,
    *,
    duration: float,
    error: Failure | None = None,
    delay: float | None = None,
) -> None:
    """Send the signal of an attempt's recorded `outcome` (LOST sends nothing): the worker and
    ``testing.run_jobs`` both use it."""
    signal = SIGNAL_OF_OUTCOME.get(outcome)
    if signal is None or not signal.receivers:
        return
    arguments: dict[str, Any] = {"job": job, "duration": duration}
    if signal is job_retried:
        arguments |= {"error": error, "delay": delay}
    elif signal is job_failed:
        arguments["error"] = error
    send(signal, type(job)._meta.concrete_model or type(job), **arguments)
