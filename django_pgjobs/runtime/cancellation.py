"""Cooperative cancellation: a running handler asks whether someone cancelled its job."""

from __future__ import annotations

import asyncio
import threading
import time
from weakref import WeakKeyDictionary

from django.db import connections, router

from django_pgjobs.models import Job
from django_pgjobs.runtime.execute import current_job

#: How often cancel_requested() asks the database; between asks, the worker's heartbeats
#: also bring the news.
CHECK_INTERVAL = 1.0

_checked_at: WeakKeyDictionary[Job, float] = WeakKeyDictionary()


def cancel_requested() -> bool:
    """True when a cancellation of the running job was requested (admin action "Cancel", or
    ``Job.objects.filter(...).cancel()``). Call it between steps of long work, in a plain or an
    ``async def`` handler; then stop, e.g. by raising ``JobCancelled``. Outside a job it is
    False.

    The answer is at most CHECK_INTERVAL seconds old: it asks the database (a primary-key
    lookup) at most that often per job.
    """
    job = current_job()
    if job is None:
        return False
    if not job.cancel_requested:
        now = time.monotonic()
        if now - _checked_at.get(job, 0.0) >= CHECK_INTERVAL:
            _checked_at[job] = now
            if _asked_now(job):
                job.cancel_requested = True
    return job.cancel_requested


def _asked_now(job: Job) -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a plain handler: ask on this thread's connection
        return asked(job)
    # An async handler's event loop may not run queries (SynchronousOnlyOperation): ask from a
    # short-lived thread with its own connection. A primary-key lookup, once a second at most.
    answer: list[bool] = []

    def ask() -> None:
        try:
            answer.append(asked(job))
        finally:
            connections.close_all()  # this thread's own connection

    thread = threading.Thread(target=ask, name="pgjobs-cancel-check", daemon=True)
    thread.start()
    thread.join()
    return bool(answer and answer[0])


def asked(job: Job) -> bool:
    """Whether a cancellation of `job` was requested, asked of the database on this thread."""
    # The write database, where the request was written: a replica behind a router may lag.
    jobs = Job.objects.db_manager(router.db_for_write(Job))
    asked: bool = jobs.filter(pk=job.pk, cancel_requested=True).exists()
    return asked
