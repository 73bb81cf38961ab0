"""django-pgjobs: a dependable PostgreSQL job queue for Django."""

from __future__ import annotations

from django_pgjobs.errors import PermanentError, Retry
from django_pgjobs.registry import Task, task

__all__ = ["PermanentError", "Retry", "Task", "task"]
