"""The verdict's arithmetic without a database: latency quantiles, retention and thresholds."""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_pgjobs.conf import Settings
from django_pgjobs.observability.health import Thresholds, thresholds
from django_pgjobs.observability.stats import latency_quantile


def test_a_latency_quantile_interpolates_within_its_bucket():
    # 10 claims at most 1 ms, 10 between 1 and 2 ms: the median is the top of the first bucket.
    assert latency_quantile([10, 10], 0.5) == pytest.approx(0.001)
    assert latency_quantile([10, 10], 0.75) == pytest.approx(0.0015)
    assert latency_quantile([0, 0, 4], 0.5) == pytest.approx(0.002 + 0.003 * 0.5)


def test_claims_beyond_the_last_bound_are_reported_as_that_bound():
    assert latency_quantile([0] * 15 + [7], 0.95) == 60.0


def test_no_claims_have_no_latency():
    assert latency_quantile([], 0.5) is None
    assert latency_quantile([0] * 16, 0.95) is None


def test_retention_as_a_timedelta_covers_succeeded_and_cancelled_and_keeps_dead_letters():
    hour = timedelta(hours=2)
    assert Settings(RETENTION=hour).retention() == {
        "succeeded": hour, "cancelled": hour, "failed": None,
    }  # fmt: skip


def test_retention_by_status_keeps_the_defaults_of_the_statuses_it_leaves_out():
    week = timedelta(days=7)
    assert Settings(RETENTION={"failed": week}).retention() == {
        "succeeded": timedelta(hours=1), "cancelled": timedelta(hours=1), "failed": week,
    }  # fmt: skip


def test_health_thresholds_override_the_defaults_and_ignore_unknown_keys(settings):
    settings.PGJOBS = {"HEALTH": {"RETRY_RATE": 0.1, "NOPE": 1}}
    assert thresholds() == Thresholds(RETRY_RATE=0.1)
