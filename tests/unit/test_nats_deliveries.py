"""What a NATS worker answers a delivered message, and how it counts a message's deliveries
(jetstream/deliveries.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nats")

from django_pgjobs.jetstream.deliveries import MAX_NAK_DELAY, FinalAnswers, Reply, answer
from django_pgjobs.outcomes import Handled, Outcome, Verdict


def test_a_retry_later_than_jetstream_can_delay_is_delayed_as_long_as_it_can_not_at_once():
    # A Retry of 500 years (pgjobs takes up to 1000) overflowed the NAK's 64-bit nanoseconds:
    # the message came back at once, again and again, until its attempts ran out.
    job = SimpleNamespace(attempts=1, max_attempts=3)  # attempts left: a NAK
    late = answer(None, job, Handled(Verdict.RETRY, delay=500 * 365 * 86400.0), float("inf"))  # type: ignore[arg-type]
    assert (late.reply, late.delay, late.outcome) == (Reply.NAK, MAX_NAK_DELAY, Outcome.RETRIED)
    assert MAX_NAK_DELAY * 1e9 < 2**63


def test_a_nak_delay_is_at_most_a_few_ack_waits_and_ends_before_the_message_expires():
    from datetime import timedelta

    from django.utils import timezone

    from django_pgjobs.jetstream.deliveries import NAK_ACK_WAITS, nak_limit

    just_published = timezone.now()
    assert nak_limit(just_published, 30.0, 0) == NAK_ACK_WAITS * 30.0
    # Stored 20 s ago in a stream keeping messages 120 s: 100 s left, less an ack wait.
    assert 69.0 < nak_limit(just_published - timedelta(seconds=20), 30.0, 120) <= 70.0
    assert nak_limit(just_published - timedelta(seconds=3590), 30.0, 3600) == 0.0


def delivered(
    sequence: int, count: int, stream: str = "PGJOBS_q", job: str = "a:0", data: bytes = b"{}"
) -> Any:
    """A delivered message as nats-py reads it: its metadata come from its reply subject."""
    from nats.aio.msg import Msg

    reply = f"$JS.ACK.{stream}.pgjobs_q.{count}.{sequence}.{count}.1764756000000000000.0"
    headers = {"Nats-Msg-Id": job}
    return Msg(None, subject="pgjobs.q", reply=reply, data=data, headers=headers)  # type: ignore[arg-type]


def test_a_delivery_count_that_goes_back_is_taken_as_one_more_than_seen():
    # nats-server before 2.10.14 may deliver a message it is redelivering once more with a
    # count of 1 (nats-server#5305): the job's attempts went 1, 2, 1, then past max_attempts
    # at the server's next count, dead-lettered as a lost worker's instead of its last attempt.
    from django_pgjobs.jetstream.deliveries import DeliveryCounts

    counts = DeliveryCounts()
    seen = [counts.of(delivered(7, n)) for n in (1, 2, 1, 4)]
    assert seen == [1, 2, 3, 4]
    assert counts.of(delivered(8, 1)) == 1  # another message: its own count
    assert counts.of(delivered(7, 1, stream="PGJOBS_other")) == 1  # another stream's
    # The stream made again (deleted, its storage lost): its sequences start again at 1
    assert counts.of(delivered(7, 1, job="b:0")) == 1


def test_the_delivery_counts_kept_are_bounded():
    from django_pgjobs.jetstream.deliveries import DeliveryCounts

    counts = DeliveryCounts()
    for sequence in range(DeliveryCounts.LIMIT + 1):
        counts.of(delivered(sequence, 2))
    assert counts.of(delivered(0, 1)) == 1  # the oldest was forgotten
    assert counts.of(delivered(DeliveryCounts.LIMIT, 1)) == 3  # the newest kept


def test_a_message_acknowledged_or_terminated_keeps_its_answer_for_its_next_deliveries():
    # nats-server 2.9.10 delivered a terminated message again, with a count of 1 (#5305,
    # #5338): the final answer is found by the message, whatever its delivery count.

    answers = FinalAnswers()
    answers.record(delivered(7, 2), Reply.TERM)
    answers.record(delivered(8, 1), Reply.ACK)
    answers.record(delivered(9, 1), Reply.NAK)  # meant to come back and run
    assert answers.of(delivered(7, 1)) is Reply.TERM
    assert answers.of(delivered(8, 3)) is Reply.ACK
    assert answers.of(delivered(9, 2)) is None
    assert answers.of(delivered(7, 1, stream="PGJOBS_other")) is None  # another stream's
    assert answers.of(delivered(7, 1, job="b:0")) is None  # a stream made again


def test_the_final_answers_kept_are_bounded():

    answers = FinalAnswers()
    for sequence in range(FinalAnswers.LIMIT + 1):
        answers.record(delivered(sequence, 1), Reply.ACK)
    assert answers.of(delivered(0, 2)) is None  # the oldest was forgotten
    assert answers.of(delivered(FinalAnswers.LIMIT, 2)) is Reply.ACK


class SettlingBridge:
    """What a NatsSource sends the server, kept instead of sent."""

    def __init__(self) -> None:
        self.acks: list[Any] = []
        self.terms: list[Any] = []

    def settle(self, acks: list[Any], naks: list[Any], terms: list[Any]) -> None:
        assert not naks
        self.acks += acks
        self.terms += terms


def a_job_message(sequence: int, count: int) -> Any:
    """A delivered message carrying a job, as a relay publishes it."""
    from django.utils import timezone

    from django_pgjobs.jetstream import messages
    from django_pgjobs.models import Job

    job = Job(id="01a2456c-3271-71bd-9cdf-5debf2eb28b0", queue="q", task="tests.tasks.ledger",
              payload={"n": 1}, run_at=timezone.now(), created_at=timezone.now(),
              max_attempts=5)  # fmt: skip
    return delivered(sequence, count, job=messages.message_id(job), data=messages.body(job))


def test_a_message_the_worker_ended_is_answered_again_unrun_and_said_once(
    caplog: pytest.LogCaptureFixture,
):
    # Before: a terminated message delivered again ran again (its dead letter was written).
    from django_pgjobs.jetstream.source import NatsSource

    bridge = SettlingBridge()
    source = NatsSource([], bridge)  # type: ignore[arg-type]
    source.id = "w1"
    terminated, acknowledged = a_job_message(7, 1), a_job_message(8, 1)
    source._final_answers.record(terminated, Reply.TERM)
    source._final_answers.record(acknowledged, Reply.ACK)
    again = [a_job_message(7, 1), a_job_message(8, 2), a_job_message(7, 2)]
    with caplog.at_level(logging.DEBUG, "django_pgjobs"):
        taken = source._take(again, sent_at=0.0)
    assert taken == [] and source.deliveries() == []
    assert (bridge.terms, bridge.acks) == ([again[0], again[2]], [again[1]])
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["INFO", "DEBUG", "DEBUG"]
    assert said[0][1].startswith(
        "worker w1: job 01a2456c-3271-71bd-9cdf-5debf2eb28b0 (tests.tasks.ledger) was delivered "
        "again after this worker terminated its message: terminated again, not run ("
    )
    assert "after this worker terminated its message: terminated again, not run" in said[0][1]
    assert "acknowledged its message: acknowledged again, not run" in said[1][1]
