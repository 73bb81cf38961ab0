"""What a NATS worker answers a delivered message (jetstream/answers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("nats")

from django_pgjobs.jetstream.answers import MAX_NAK_DELAY, Reply, answer
from django_pgjobs.outcomes import Handled, Outcome, Verdict


def test_a_retry_later_than_jetstream_can_delay_is_delayed_as_long_as_it_can_not_at_once():
    # A Retry of 500 years (pgjobs takes up to 1000) overflowed the NAK's 64-bit nanoseconds:
    # the message came back at once, again and again, until its attempts ran out.
    job = SimpleNamespace(attempts=1, max_attempts=3)  # attempts left: a NAK
    late = answer(None, job, Handled(Verdict.RETRY, delay=500 * 365 * 86400.0))  # type: ignore[arg-type]
    assert (late.reply, late.delay, late.outcome) == (Reply.NAK, MAX_NAK_DELAY, Outcome.RETRIED)
    assert MAX_NAK_DELAY * 1e9 < 2**63
