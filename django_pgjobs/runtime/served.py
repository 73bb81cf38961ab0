"""What a worker says at start about its queues: those it serves that nothing enqueues into
(a typo in --queue?), and the tasks' queues that no running worker serves (their jobs wait).
Warnings only: the worker runs all the same."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from django.conf import settings as django_settings
from django.db import DatabaseError

from django_pgjobs import periodic, registry
from django_pgjobs.conf import get_settings
from django_pgjobs.observability import stats
from django_pgjobs.runtime.reporting import quietly

logger = logging.getLogger("django_pgjobs.runtime.worker")

#: Django's Tasks framework's default queue (DEFAULT_TASK_QUEUE_NAME), for a backend whose
#: QUEUES setting allows any queue.
DJANGO_TASKS_QUEUE = "default"
BACKEND = "django_pgjobs.backend.PgJobsBackend"


def used_queues() -> dict[str, list[str]]:
    """The queues this process's code enqueues into, each with who uses it: registered tasks,
    periodic schedules, and the QUEUES of Django Tasks backends that are django-pgjobs'."""
    default = get_settings().DEFAULT_QUEUE
    used: dict[str, list[str]] = {}
    for task in registry.all_tasks().values():
        used.setdefault(task.queue or default, []).append(task.name)
    tasks = registry.all_tasks()
    for schedule in periodic.declared()[0]:
        of_task = tasks[schedule.task].queue if schedule.task in tasks else None
        queue = schedule.queue or of_task or default
        used.setdefault(queue, []).append(f"periodic schedule {schedule.name}")
    tasks_settings = getattr(django_settings, "TASKS", {}) or {}
    for alias, backend in tasks_settings.items():
        if isinstance(backend, dict) and backend.get("BACKEND") == BACKEND:
            for queue in backend.get("QUEUES") or [DJANGO_TASKS_QUEUE]:
                used.setdefault(queue, []).append(f"Django Tasks of TASKS[{alias!r}]")
    return used


def warn(db: str, queues: Sequence[str], who: str) -> None:
    """Log a warning for each queue served that nothing uses, and one for the tasks' queues
    that neither `who` (a worker, or a supervisor's workers) nor another running worker
    serves."""
    used = used_queues()
    for queue in queues:
        if queue not in used:
            quietly(
                logger.warning,
                "the queue %r, served by %s, is used by no registered task, periodic schedule or "
                "Django Tasks backend (%s): a typo in --queue? Jobs reach it only when "
                "enqueued with queue=%r.",
                queue, who, _what_they_use(used), queue,
            )  # fmt: skip
    unserved = sorted(set(used) - set(queues))
    if not unserved:
        return
    try:
        others = stats.served_queues(stats.worker_stats(db))
    except DatabaseError:
        return  # the worker's loop says what is wrong with the database
    for queue in unserved:
        if queue not in others:
            quietly(
                logger.warning,
                "no running worker serves the queue %r, which %s %s: its jobs wait until a "
                "worker does (runjobs --queue %s; served by %s: %s).",
                queue, _listed(used[queue]), "uses" if len(used[queue]) == 1 else "use", queue,
                who, _listed(queues),
            )  # fmt: skip


def _what_they_use(used: dict[str, list[str]]) -> str:
    if used:
        return f"they use {_listed(sorted(used))}"
    # Nothing at all: most likely the app whose tasks module declares them is not installed.
    return "no task is registered at all: is the app with your tasks module in INSTALLED_APPS?"


def _listed(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
