"""Flow control's rules without a database (limits.py): how a rate reads, the starts a bucket
holds, and each job's limit key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_pgjobs.errors import EnqueueError
from django_pgjobs.limits import Rate, TaskLimits, describe, key_of, parse_rate
from django_pgjobs.registry import Task

NOW = datetime(2026, 12, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "rate", "burst"),
    [("10/s", Rate(10, 1.0), 2), ("20/s", Rate(20, 1.0), 4), (" 100 / m ", Rate(100, 60.0), 1),
     ("1/h", Rate(1, 3600.0), 1), ("1000/s", Rate(1000, 1.0), 200)],
)  # fmt: skip
def test_a_rate_reads_as_starts_per_second_minute_or_hour_with_a_fifth_of_a_second_burst(
    text: str, rate: Rate, burst: int
) -> None:
    assert parse_rate(text, "rate_limit") == rate
    assert rate.burst == burst
    assert str(rate) == text.replace(" ", "")


@pytest.mark.parametrize(
    "text", ["10", "10/d", "0/s", "-1/s", "1.5/s", "ten/s", "", None, 10, "1000001/s"]
)
def test_anything_else_is_refused_saying_how_to_write_one(text: object) -> None:
    with pytest.raises(ValueError, match=r"write a whole number of starts from 1 to 1,000,000"):
        parse_rate(text, "rate_limit")


def test_a_full_bucket_holds_its_burst_and_gets_a_start_back_every_interval() -> None:
    rate = Rate(20, 1.0)  # every 50 ms, 4 at once
    assert rate.starts(None, NOW) == rate.starts(NOW - timedelta(hours=1), NOW) == 4
    after_four = NOW + timedelta(seconds=4 * rate.interval)
    assert rate.starts(after_four, NOW) == 0
    assert rate.starts(after_four, NOW + timedelta(milliseconds=49)) == 0
    assert rate.starts(after_four, NOW + timedelta(milliseconds=50)) == 1
    assert rate.starts(after_four, NOW + timedelta(milliseconds=100)) == 2


@given(st.lists(st.tuples(st.floats(0, 2), st.integers(1, 10)), max_size=40))
def test_no_second_ever_starts_more_than_the_rate_and_its_burst(
    claims: list[tuple[float, int]],
) -> None:
    """Claims at increasing times, each taking what the bucket holds (up to what it wants), as
    CLAIM_KEYED takes and spends it."""
    rate = Rate(20, 1.0)
    full_at, now, starts = None, NOW, []
    for gap, wanted in claims:
        now += timedelta(seconds=gap)
        taken = min(wanted, rate.starts(full_at, now))
        if taken:
            full_at = max(full_at or now, now) + timedelta(seconds=rate.interval * taken)
        starts += [now] * taken
    for n, start in enumerate(starts):
        within = [s for s in starts[n:] if s < start + timedelta(seconds=1)]
        assert len(within) <= 20 + rate.burst


def limited(**options: object) -> Task:
    def export(customer_id: str = "", n: int = 0) -> None: ...

    return Task(func=export, name="shop.export", **options)  # type: ignore[arg-type]


def test_a_jobs_key_is_its_limit_by_value_as_text_or_empty_for_the_whole_task() -> None:
    assert key_of(limited(), {"customer_id": "a"}) is None
    assert key_of(limited(concurrency_limit=2), {}) == ""
    assert key_of(limited(limit_by="customer_id"), {"customer_id": 42}) == "42"
    by_host = limited(limit_by=lambda payload: payload["customer_id"].split("@")[1])
    assert key_of(by_host, {"customer_id": "ann@example.com"}) == "example.com"


@pytest.mark.parametrize(
    ("task", "payload", "says"),
    [
        (limited(limit_by="customer_id"), {}, "limited by 'customer_id', which this payload lacks"),
        (limited(limit_by="customer_id"), {"customer_id": True}, "a string or a whole number"),
        (limited(limit_by=lambda p: 7), {}, "returned 7; it must return a string"),
        (limited(limit_by=lambda p: p["x"]), {}, "its limit_by function raised KeyError"),
        (limited(limit_by=lambda p: "a\x00b"), {}, "holds a NUL or a lone surrogate"),
        (limited(limit_by=lambda p: "a\ud800"), {}, "holds a NUL or a lone surrogate"),
    ],
)
def test_a_payload_without_a_usable_key_is_refused_saying_why(
    task: Task, payload: dict[str, object], says: str
) -> None:
    with pytest.raises(EnqueueError, match=says):
        key_of(task, payload)


def test_the_claims_limits_hold_each_limited_task_and_lock_only_those_with_a_limit() -> None:
    tasks = {
        "a": Task(func=print, name="a"),
        "b": Task(func=print, name="b", rate_limit=Rate(10, 1.0)),
        "c": Task(func=print, name="c", concurrency_limit=3, limit_by="x"),
        "d": Task(func=print, name="d", limit_by="x"),
    }
    limits = TaskLimits.of(tasks)
    assert limits.tasks == ("b", "c", "d")
    assert limits.concurrency == (None, 3, None)
    assert limits.every == (0.1, None, None)
    assert limits.locking == ["b", "c"]
    assert limits.counted == {"c"}
    assert describe(tasks["b"]) == "10/s"
    assert describe(tasks["c"]) == "3 at once, per x"
    assert describe(tasks["d"]) == "turns per x"
    assert describe(Task(func=print, name="e", limit_by=lambda p: "")) == "turns per key"
    assert TaskLimits.of({"a": tasks["a"]}) == TaskLimits()
