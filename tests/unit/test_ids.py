"""Job ids: UUIDv7, time-ordered, and a bulk insert's ids ascending."""

from __future__ import annotations

import time

from django_pgjobs.ids import uuid7, uuid7_batch


def _unix_ms(value: object) -> int:
    return int(str(value).replace("-", "")[:12], 16)


def test_a_batch_of_ids_is_ascending_unique_version_7_and_of_now():
    before = time.time_ns() // 1_000_000
    ids = uuid7_batch(20_000)
    after = time.time_ns() // 1_000_000
    assert ids == sorted(ids)
    assert len(set(ids)) == 20_000
    assert {(u.version, u.variant) for u in ids} == {(7, "specified in RFC 4122")}
    assert {before <= _unix_ms(u) <= after for u in ids} == {True}


def test_batches_of_ids_do_not_repeat_each_other():
    assert not set(uuid7_batch(1000)) & set(uuid7_batch(1000))


def test_an_id_for_a_moment_carries_that_moment():
    job_id = uuid7(1_700_000_000.5)
    assert (job_id.version, _unix_ms(job_id)) == (7, 1_700_000_000_500)
