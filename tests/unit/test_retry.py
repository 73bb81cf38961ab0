from __future__ import annotations

import statistics
import threading
import time

import pytest
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import OperationalError

from django_pgjobs.errors import PayloadMismatch, PermanentError, Retry
from django_pgjobs.retry import ExponentialBackoff, backoff_seconds, is_permanent


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


def test_a_backoff_called_within_a_limit_that_hangs_is_given_up_once_and_not_called_again():
    release = threading.Event()
    calls: list[int] = []

    def hangs(attempts: int) -> float:
        calls.append(attempts)
        release.wait(30)
        return 5.0

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the backoff of app.hangs did not return within 0.2s"):
        backoff_seconds(hangs, 1, "app.hangs", within=0.2)
    assert 0.2 <= time.monotonic() - started < 2
    with pytest.raises(TimeoutError, match="has not returned from an earlier call"):
        backoff_seconds(hangs, 2, "app.hangs", within=0.2)
    assert calls == [1]  # at most one thread held by a backoff that hangs
    assert backoff_seconds(lambda n: 3, 1, "app.other", within=0.2) == 3.0
    release.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # once it returns, it is asked again
        try:
            assert backoff_seconds(hangs, 3, "app.hangs", within=0.2) == 5.0
            break
        except TimeoutError:
            time.sleep(0.01)
    assert calls == [1, 3]


@pytest.mark.parametrize("within", [None, 1.0])
def test_what_a_backoff_raises_or_returns_is_an_error_naming_the_task(within):
    def exits(attempts: int) -> float:
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match=r"^the backoff of app.exits raised SystemExit: 3$"):
        backoff_seconds(exits, 1, "app.exits", within=within)
    with pytest.raises(ValueError, match=r"the backoff of app.inf must be zero or more seconds"):
        backoff_seconds(lambda n: float("inf"), 1, "app.inf", within=within)


def test_a_backoff_too_slow_after_a_time_out_gives_way_to_the_default_and_says_so():
    from django_pgjobs.errors import JobTimeout
    from django_pgjobs.models import Job
    from django_pgjobs.runtime import execute

    release = threading.Event()
    job = Job(task="app.slow", attempts=1, max_attempts=5)
    try:
        handled = execute.raised(
            job, JobTimeout("too long"), lambda n: release.wait(30) and 600.0, (), 0.0, within=0.1
        )
    finally:
        release.set()
    assert not handled.permanent and 0 <= handled.delay <= 1  # the default: BACKOFF_BASE
    assert handled.failure is not None
    assert handled.failure.message == (
        "too long; the backoff of app.slow did not return within 0.1s: the default backoff applies"
    )
