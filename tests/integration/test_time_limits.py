"""How a worker says that an attempt passed its time limit: once."""

from __future__ import annotations

import logging
import threading

import pytest

from django_pgjobs.models import Job
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until


@pytest.mark.django_db(transaction=True)
def test_an_attempt_past_its_time_limit_is_said_once(caplog):
    # It was said twice: an ERROR when the attempt was abandoned, then the outcome's own line.
    from tests import hostile

    hostile.async_time_limit_seen.clear()
    job = Job.objects.enqueue("tests.hostile.awaits_past_its_time_limit")  # 0.5 s, 1 attempt
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, poll_interval=0.1))
    thread = threading.Thread(target=worker.run)
    with caplog.at_level(logging.INFO, "django_pgjobs"):
        thread.start()
        try:
            wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.FAILED, 10)
        finally:
            worker.stop()
            thread.join(10)
    said = [r for r in caplog.records if str(job.pk) in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        (
            "ERROR",
            f"job {job.pk} (tests.hostile.awaits_past_its_time_limit) attempt 1 failed: "
            "django_pgjobs.errors.JobTimeout: the attempt ran longer than its time limit of "
            "0.5s; dead-lettered",
        )
    ]
