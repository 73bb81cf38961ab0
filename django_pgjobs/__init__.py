"""django-pgjobs: a dependable PostgreSQL job queue for Django."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django_pgjobs.errors import PermanentError, Retry
from django_pgjobs.registry import Task, task

if TYPE_CHECKING:
    from django_pgjobs.models import Job


def current_job() -> Job | None:
    """The Job whose handler is running in this thread, else None (see execute.current_job)."""
    from django_pgjobs.execute import current_job

    return current_job()


__all__ = ["PermanentError", "Retry", "Task", "current_job", "task"]
