"""What the report reads of a message in a stream (jetstream/messages.py): the due time of a
body of ours, and none of any other."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

pytest.importorskip("nats")

from django_pgjobs.jetstream.messages import due_at


@pytest.mark.parametrize(
    "body",
    [None, b"", b"{", b"[]", b'"x"', b"{}", b'{"run_at": 5}', b'{"run_at": "soon"}',
     b'{"run_at": "2026-12-02T10:00:00"}',  # no time zone, so no instant
     b"[" * 100_000],  # json raises RecursionError
)  # fmt: skip
def test_a_body_not_ours_has_no_due_time(body):
    assert due_at(body) is None


def test_a_body_of_ours_gives_its_jobs_run_at():
    found = due_at(b'{"v": 1, "run_at": "2026-12-02T10:00:00.5+01:00"}')
    assert found == datetime(2026, 12, 2, 9, 0, 0, 500000, tzinfo=UTC)
