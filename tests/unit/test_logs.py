"""The worker's summary line: a rate that means something, or none."""

from __future__ import annotations

import logging

import pytest

from django_pgjobs.observability.activity import ActivityTally
from django_pgjobs.outcomes import Outcome
from django_pgjobs.runtime.logs import log_activity, rate
from tests.factories import JobFactory


@pytest.mark.parametrize(
    ("jobs", "seconds", "shown"),
    [
        (2316, 10.0, " (232 jobs/s)"),
        (3, 10.0, " (0.3 jobs/s)"),  # was "(0 jobs/s)"
        (57, 10.0, " (5.7 jobs/s)"),
        (1, 600.0, " (0.0017 jobs/s)"),
        (3, 0.2, ""),  # a --once run of a moment: no rate worth showing
        (0, 10.0, ""),
    ],
)
def test_the_rate_shows_two_significant_digits_under_ten_and_none_for_a_short_span(
    jobs, seconds, shown
):
    assert rate(jobs, seconds) == shown


def test_the_summary_line_of_three_jobs(caplog):
    tally = ActivityTally()
    for job in JobFactory.build_batch(3):
        tally.finished(job, Outcome.SUCCEEDED)
    with caplog.at_level(logging.INFO, logger="django_pgjobs.runtime.worker"):
        log_activity(tally, 10.0, in_flight=0)
        log_activity(tally, 0.2, in_flight=0)
    assert caplog.messages == [
        "last 10s: done=3 retried=0 dead=0 cancelled=0 lost=0 in_flight=0 (0.3 jobs/s)",
        "last 0.2s: done=3 retried=0 dead=0 cancelled=0 lost=0 in_flight=0",
    ]
