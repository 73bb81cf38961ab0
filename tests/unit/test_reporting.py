"""What a worker tells of its work (runtime/reporting.py): its summary line, with a rate that
means something or none, and its outcome signals, sent on a thread of their own, in order,
never holding up the worker."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_pgjobs import signals
from django_pgjobs.data.records import Failure
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime import reporting
from django_pgjobs.runtime.reporting import (
    ActivityTally,
    Announcer,
    log_activity,
    log_outcome,
    rate,
)
from tests.factories import JobFactory

# ---- log lines ------------------------------------------------------------------------------


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
        tally.finished(job, Outcome.SUCCEEDED, 0.01)
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


# ---- outcome signals ------------------------------------------------------------------------


HANDLED = Handled(Verdict.SUCCEEDED, duration=0.1)


@pytest.fixture
def heard() -> Iterator[list[tuple[str, str, str]]]:
    """(signal, job's task, thread) of each job_succeeded and job_failed received."""
    log: list[tuple[str, str, str]] = []

    def receiver(sender: Any, signal: Any, job: Job, **kwargs: Any) -> None:
        name = "succeeded" if signal is signals.job_succeeded else "failed"
        log.append((name, job.task, threading.current_thread().name))

    signals.job_succeeded.connect(receiver, weak=False)
    signals.job_failed.connect(receiver, weak=False)
    yield log
    signals.job_succeeded.disconnect(receiver)
    signals.job_failed.disconnect(receiver)


def test_outcome_signals_are_sent_in_order_on_a_thread_of_their_own(heard):
    sender = Announcer()
    for n in range(5):
        outcome = Outcome.SUCCEEDED if n % 2 == 0 else Outcome.FAILED
        sender.announce(Job(task=f"app.t{n}"), HANDLED, outcome)
    sender.announce(Job(task="app.lost"), HANDLED, Outcome.LOST)  # no signal
    sender.stop(within=5)
    assert heard == [
        ("succeeded", "app.t0", "pgjobs-signals"),
        ("failed", "app.t1", "pgjobs-signals"),
        ("succeeded", "app.t2", "pgjobs-signals"),
        ("failed", "app.t3", "pgjobs-signals"),
        ("succeeded", "app.t4", "pgjobs-signals"),
    ]


def test_no_thread_is_started_while_no_signal_has_a_receiver(monkeypatch):
    monkeypatch.setattr(signals.job_succeeded, "receivers", [])  # the tests connect some
    sender = Announcer()
    sender.announce(Job(task="app.t"), HANDLED, Outcome.SUCCEEDED)
    sender.flush()
    assert sender._thread is None


def test_a_receiver_that_hangs_delays_only_the_signals_after_it(monkeypatch, caplog):
    monkeypatch.setattr(reporting, "BACKLOG", 3)
    release = threading.Event()

    def hangs(sender: Any, **kwargs: Any) -> None:
        release.wait(30)

    signals.job_succeeded.connect(hangs, weak=False)
    try:
        sender = Announcer()
        started = time.monotonic()
        for n in range(10):  # one being sent, two waiting, seven dropped
            sender.announce(Job(task=f"app.t{n}"), HANDLED, Outcome.SUCCEEDED)
            sender.flush()  # a turn each
        with caplog.at_level(logging.WARNING):
            sender.stop(within=0.2)
        assert time.monotonic() - started < 5
        assert sender._dropped == 7
    finally:
        release.set()
        signals.job_succeeded.disconnect(hangs)
    assert "outcome signals dropped" in caplog.text
    assert "a receiver did not return within 0.2s" in caplog.text


def test_a_receiver_raising_system_exit_is_logged_and_the_next_signals_are_sent(heard, caplog):
    def exits(sender: Any, job: Job, **kwargs: Any) -> None:
        if job.task == "app.exits":
            raise SystemExit(5)

    signals.job_succeeded.connect(exits, weak=False)
    try:
        sender = Announcer()
        sender.announce(Job(task="app.exits"), HANDLED, Outcome.SUCCEEDED)
        sender.flush()
        sender.announce(Job(task="app.next"), HANDLED, Outcome.SUCCEEDED)
        sender.stop(within=5)
    finally:
        signals.job_succeeded.disconnect(exits)
    assert ("succeeded", "app.next", "pgjobs-signals") in heard
    assert "a signal's receiver raised" in caplog.text
