"""django-pgjobs: a dependable PostgreSQL job queue for Django."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from django_pgjobs.errors import JobCancelled, PermanentError, Retry
from django_pgjobs.registry import Task, task

if TYPE_CHECKING:
    from django_pgjobs.models import Batch, Job


def current_job() -> Job | None:
    """The Job whose handler is running in this thread, else None (see execute.current_job)."""
    # Imported when called: the package loads before Django's models can (see apps.py).
    from django_pgjobs.runtime.execute import current_job

    return current_job()


def cancel_requested() -> bool:
    """Whether a cancellation of the running job was requested (see runtime/execute.py)."""
    from django_pgjobs.runtime.execute import cancel_requested

    return cancel_requested()


def progress(done: float, total: float | None = None, note: str = "") -> None:
    """Report the running job's progress: `done` of `total` (None: not known), with a short
    `note`. Cheap enough to call for every item: the worker writes the latest report about once
    a second. Outside a job it only checks its arguments (see runtime/execute.py)."""
    from django_pgjobs.runtime.execute import progress

    progress(done, total, note)


def batch(
    on_complete: Task | str | None = None, on_success: Task | str | None = None, **payload: Any
) -> AbstractContextManager[Batch]:
    """``with batch(on_complete=..., on_success=..., **payload) as b:`` makes the jobs enqueued
    in the block one batch (JobManager.batch, batches.py)."""
    # Looked up by label: this module loads with the package, before the models can.
    from django.apps import apps

    return apps.get_model("pgjobs", "Job").objects.batch(on_complete, on_success, **payload)


__all__ = [
    "JobCancelled",
    "PermanentError",
    "Retry",
    "Task",
    "batch",
    "cancel_requested",
    "current_job",
    "progress",
    "task",
]
