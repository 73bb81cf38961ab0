"""The worker's summary line: a rate that means something, or none."""

from __future__ import annotations

import logging

import pytest

from django_pgjobs.data.records import Failure
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime.reporting import ActivityTally, log_activity, log_outcome, rate
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


def outcome_records(caplog, level, outcome, handled):
    job = JobFactory.build(attempts=2)
    with caplog.at_level(level, logger="django_pgjobs.runtime.worker"):
        log_outcome(job, handled, outcome)
    return job, caplog.records


def test_a_success_logs_no_line_above_debug(caplog):
    _, records = outcome_records(
        caplog, logging.INFO, Outcome.SUCCEEDED, Handled(Verdict.SUCCEEDED, duration=0.25)
    )
    assert records == []


def test_a_success_at_debug_logs_a_line_with_the_jobs_fields_as_extras(caplog):
    job, (record,) = outcome_records(
        caplog, logging.DEBUG, Outcome.SUCCEEDED, Handled(Verdict.SUCCEEDED, duration=0.25)
    )
    assert record.getMessage() == f"job {job.pk} (tests.tasks.noop) succeeded"
    assert (record.job_id, record.task, record.queue, record.attempt, record.duration) == (
        str(job.pk), "tests.tasks.noop", "default", 2, 0.25,
    )  # fmt: skip


def test_a_failed_attempt_logs_its_error_and_status_with_the_jobs_fields(caplog):
    failed = Handled(Verdict.ERROR, failure=Failure("RuntimeError", "boom"), duration=0.5)
    job, (record,) = outcome_records(caplog, logging.INFO, Outcome.RETRIED, failed)
    assert record.levelno == logging.INFO
    assert (
        record.getMessage()
        == f"job {job.pk} (tests.tasks.noop) attempt 2 failed: RuntimeError: boom"
    )
    assert (record.job_id, record.attempt, record.duration) == (str(job.pk), 2, 0.5)
    assert (record.error, record.status) == ("RuntimeError: boom", "retried")
