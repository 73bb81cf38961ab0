"""Each bad input to enqueue is a specific, readable error (the "writes nothing" half of the
contract is in tests/integration/test_enqueue.py)."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import uuid

import pytest

from django_pgjobs.errors import EnqueueError
from django_pgjobs.validation import (
    check_delay,
    check_priority,
    check_queue,
    check_run_at,
    payload_json,
)

LIMIT = 1_000_000


def _nested(levels: int) -> list[object]:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ("text", "must be a JSON object"),
        ({"a": float("nan")}, r"payload\['a'\] is nan"),
        ({"a": [1, float("inf")]}, r"payload\['a'\]\[1\] is inf"),
        ({"note": "a\x00b"}, r"payload\['note'\] contains a NUL"),
        ({"note": "\ud800"}, "lone surrogate"),
        ({"when": dt.datetime(2026, 1, 1)}, r"payload\['when'\] is a datetime"),
        ({"amount": decimal.Decimal("1.5")}, "Decimal"),
        ({"ids": {1, 2}}, "set"),
        ({"pair": (1, 2)}, "tuple"),
        ({"id": uuid.uuid4()}, "UUID"),
        ({"raw": b"x"}, "bytes"),
        ({1: "x"}, "must be strings"),
        ({"deep": {"er": {"x\x00": 1}}}, r"payload\['deep'\]\['er'\] key"),
    ],
)
def test_payloads_that_do_not_survive_json_are_refused_naming_the_path(payload, message):
    with pytest.raises(EnqueueError, match=message):
        payload_json(payload, LIMIT)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"n": 1 << 14_001}, r"payload\['n'\] is an integer of 14,002 bits"),
        ({"a": [[[]]] * 2 + [[[[float("-inf")]]]]}, r"payload\['a'\]\[2\]\[0\]\[0\]\[0\] is -inf"),
        ({"k\udc80": 1}, "lone surrogate"),
        ({"deep": _nested(70)}, "more than 64 levels deep"),
    ],
)
def test_what_the_json_text_cannot_show_is_refused_naming_the_path(payload, message):
    with pytest.raises(EnqueueError, match=message):
        payload_json(payload, LIMIT)


class Colour(enum.StrEnum):
    RED = "red"


def test_subclasses_of_json_types_and_escaped_text_pass():
    assert payload_json({"colour": Colour.RED, "path": "C:\\u0000"}, LIMIT) == (
        '{"colour":"red","path":"C:\\\\u0000"}'
    )
    assert payload_json(collections.OrderedDict(n=True), LIMIT) == '{"n":true}'


def test_an_over_large_payload_is_refused_with_its_size_and_the_limit():
    with pytest.raises(EnqueueError, match=r"over the limit of 1,000 .*MAX_PAYLOAD_BYTES"):
        payload_json({"blob": "x" * 2000}, 1000)


def test_a_good_payload_becomes_compact_json():
    assert payload_json({"a": [1, 2.5, None, True], "b": "é"}, LIMIT) == (
        '{"a":[1,2.5,null,true],"b":"é"}'
    )


@pytest.mark.parametrize(
    "queue", ["", "has space", "semi;colon", "quote'd", "-leading", "x" * 101, None, 3]
)
def test_malformed_queue_names_are_refused(queue):
    with pytest.raises(EnqueueError, match="not a valid queue name"):
        check_queue(queue)


@pytest.mark.parametrize("priority", [-101, 101, 1.5, True, "1"])
def test_priority_outside_the_tasks_framework_range_is_refused(priority):
    with pytest.raises(EnqueueError, match="priority"):
        check_priority(priority)


def test_naive_datetimes_are_refused():
    with pytest.raises(EnqueueError, match="naive datetime"):
        check_run_at(dt.datetime(2030, 1, 1))


@pytest.mark.parametrize("delay", [-1, float("nan"), float("inf"), dt.timedelta(seconds=-5), "5"])
def test_negative_or_non_numeric_delays_are_refused(delay):
    with pytest.raises(EnqueueError, match="delay"):
        check_delay(delay)
