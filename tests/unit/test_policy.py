"""How many jobs a worker claims beyond its threads: what they start within PREFETCH_HORIZON."""

from __future__ import annotations

import pytest

from django_pgjobs.runtime.policy import PREFETCH_HORIZON, prefetch


def prefetch_for(mean_duration: float | None, concurrency: int = 10, batch: int = 100) -> int:
    return prefetch(concurrency, batch, mean_duration)


def test_nothing_is_prefetched_before_any_job_has_finished():
    assert prefetch_for(None) == 0


@pytest.mark.parametrize(
    ("mean_duration", "expected"),
    [
        (0.00002, 100),  # no-op jobs: a full batch, whatever the threads
        (0.01, 50),  # 10 threads start 50 jobs of 10 ms within the horizon
        (0.1, 5),
        (1.0, 0),  # slow jobs are never hoarded from other workers
        (60.0, 0),
    ],
)
def test_the_prefetch_is_what_the_threads_start_within_the_horizon(mean_duration, expected):
    assert PREFETCH_HORIZON == 0.05
    assert prefetch_for(mean_duration) == expected


def test_the_prefetch_never_exceeds_the_batch_size():
    assert prefetch_for(0.00001, concurrency=4, batch=7) == 7
