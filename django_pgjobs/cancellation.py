"""Cooperative cancellation: a running handler asks whether someone cancelled its job."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from django_pgjobs.execute import current_job

if TYPE_CHECKING:
    from django_pgjobs.models import Job

#: How often cancel_requested() asks the database; between asks, the worker's heartbeats
#: also bring the news.
CHECK_INTERVAL = 1.0

_checked_at: WeakKeyDictionary[Job, float] = WeakKeyDictionary()


def cancel_requested() -> bool:
    """True when a cancellation of the running job was requested (admin action "Cancel", or
    ``Job.objects.filter(...).cancel()``). Call it between steps of long work; then stop, e.g.
    by raising ``JobCancelled``. Outside a job it is False.

    The answer is at most CHECK_INTERVAL seconds old: it asks the database (a primary-key
    lookup) at most that often per job.
    """
    from django_pgjobs.models import Job

    job = current_job()
    if job is None:
        return False
    if not job.cancel_requested:
        now = time.monotonic()
        if now - _checked_at.get(job, 0.0) >= CHECK_INTERVAL:
            _checked_at[job] = now
            if Job.objects.filter(pk=job.pk, cancel_requested=True).exists():
                job.cancel_requested = True
    return job.cancel_requested
