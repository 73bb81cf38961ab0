from __future__ import annotations

import statistics

import pytest
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import OperationalError

from django_pgjobs.errors import PayloadMismatch, PermanentError, Retry
from django_pgjobs.retry import ExponentialBackoff, is_permanent


def test_backoff_delays_stay_within_the_full_jitter_window():
    backoff = ExponentialBackoff(base=2, cap=60)
    for attempts in range(1, 12):
        ceiling = min(60, 2 * 2 ** (attempts - 1))
        delays = [backoff(attempts) for _ in range(200)]
        assert all(0 <= delay <= ceiling for delay in delays)


def test_backoff_delays_grow_with_attempts_until_the_cap():
    backoff = ExponentialBackoff(base=1, cap=100)
    means = [statistics.mean(backoff(n) for _ in range(2000)) for n in range(1, 8)]
    assert means == sorted(means)
    assert means[-1] > 10 * means[0]
    assert max(backoff(40) for _ in range(200)) <= 100


def test_backoff_spreads_retries_instead_of_bunching_them():
    delays = [ExponentialBackoff(base=10, cap=10)(5) for _ in range(1000)]
    assert statistics.pstdev(delays) > 2  # uniform on [0, 10] has a stdev of ~2.9


@pytest.mark.parametrize(
    "error",
    [PermanentError("x"), ObjectDoesNotExist("x"), ValidationError("x"), PayloadMismatch("x")],
)
def test_errors_retrying_cannot_fix_are_permanent(error):
    assert is_permanent(error)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("x"), OperationalError("deadlock detected"), TypeError("x"), SystemExit()],
)
def test_other_errors_are_transient(error):
    assert not is_permanent(error)


def test_a_task_can_declare_its_own_permanent_errors():
    assert is_permanent(KeyError("x"), (LookupError,))


def test_retry_takes_seconds_or_a_timedelta_and_refuses_negative_delays():
    from datetime import timedelta

    assert Retry(timedelta(minutes=2)).delay == 120
    assert Retry(1.5).delay == 1.5
    with pytest.raises(ValueError, match="zero or more seconds"):
        Retry(-1)
