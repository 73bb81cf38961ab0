"""runjobs processes enqueueing a per-second schedule together: one job per tick, none missing."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from django_pgjobs.models import Job
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess

pytestmark = pytest.mark.django_db(transaction=True)

PER_SECOND = {
    "ticker": {"task": "tests.tasks.periodic_tick", "cron": "* * * * * *", "pass_tick": True}
}


def ticks() -> Counter[str]:
    return Counter(Job.objects.values_list("payload__tick", flat=True))


def seconds_of_ticks(request: pytest.FixtureRequest) -> int:
    """16 s in the normal suite; 3 minutes with --chaos-full or PGJOBS_PERIODIC_FULL=1."""
    full = request.config.getoption("--chaos-full") or os.environ.get("PGJOBS_PERIODIC_FULL")
    return 180 if full else 16


def test_four_workers_enqueue_a_per_second_schedule_once_per_tick_none_missing(
    request, tmp_path: Path
):
    seconds = seconds_of_ticks(request)
    env = {"PGJOBS_TEST_PERIODIC": json.dumps(PER_SECOND)}
    workers = [
        WorkerProcess(["--concurrency", "2", "--grace", "5"], tmp_path / f"worker-{n}.log", env)
        for n in range(4)
    ]
    try:
        wait_until(lambda: all(worker.started() for worker in workers), timeout=30)
        wait_until(lambda: len(ticks()) >= seconds, timeout=seconds + 60, interval=0.2)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        assert [worker.wait(30) for worker in workers] == [0, 0, 0, 0]
    finally:
        for worker in workers:
            worker.kill()
            sys.stderr.write(f"--- {worker.log_path.name} ---\n{worker.log()[-2000:]}\n")
    counts = ticks()
    assert set(counts.values()) == {1}, [tick for tick, n in counts.items() if n > 1]
    times = sorted(map(datetime.fromisoformat, counts))
    missing = sorted(set(times[0] + timedelta(seconds=n) for n in range(len(times))) - set(times))
    assert not missing, missing
    assert len(times) >= seconds
    sys.stderr.write(f"{len(times)} ticks, from {times[0]} to {times[-1]}, one job each\n")
