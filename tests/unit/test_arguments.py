"""A payload against its handler's signature: one check, and messages that say what to change."""

from __future__ import annotations

import pytest

from django_pgjobs.arguments import check_arguments
from django_pgjobs.errors import PayloadMismatch
from tests import tasks

FITTING = [
    (tasks.send_email, {"to": "a@example.com"}),
    (tasks.keyword_only, {"order_id": 1}),
    (tasks.takes_varargs, {"order_id": 1}),
    (tasks.takes_anything, {"order_id": 1, "whatever": [1], "else": None}),
    (tasks.greet, {"name": "Ada"}),
    (tasks.decorated, {"order_id": 1}),
    (tasks.async_noop, {"value": 1}),
]


@pytest.mark.parametrize(("handler", "payload"), FITTING, ids=lambda value: str(value)[:30])
def test_a_payload_that_fits_passes(handler, payload):
    check_arguments(handler.func, handler.name, (), payload)


MISFITS = [
    (
        tasks.send_email,
        {"recipient": "a@example.com"},
        "the payload does not fit tests.tasks.send_email(to, subject=''): unexpected argument "
        "'recipient'; missing the required argument 'to'",
    ),
    (
        tasks.send_email,
        {"to": "a@example.com", "countdown": 10},
        "unexpected argument 'countdown' ('countdown' looks like an enqueue option: pass "
        "delay=... with task.using(delay=...).enqueue(...)",
    ),
    (tasks.send_email, {"to": "a", "eta": "2030-01-01"}, "pass run_at=..."),
    (tasks.send_email, {"too": "a"}, "unexpected argument 'too' (did you mean 'to'?)"),
    (
        tasks.positional_only,
        {"order_id": 1},
        "tests.tasks.positional_only(order_id, /, note=''): 'order_id' is a positional-only "
        "argument, and a payload passes keyword arguments",
    ),
    (
        tasks.positional_only,
        {},
        "'order_id' is a required positional-only argument, which a payload of keyword "
        "arguments cannot give",
    ),
    (
        tasks.keyword_only,
        {"note": "x"},
        "tests.tasks.keyword_only(*, order_id, note=''): missing the required argument 'order_id'",
    ),
    (tasks.takes_varargs, {}, "(*args, order_id): missing the required argument 'order_id'"),
    (tasks.takes_anything, {"other": 1}, "(order_id, **options): missing the required argument"),
    (tasks.greet, {"nme": "Ada"}, "tests.tasks.greet(name): unexpected argument 'nme'"),
    # functools.wraps: the wrapped function's signature, not the wrapper's (*args, **kwargs).
    (tasks.decorated, {"order": 1}, "tests.tasks.decorated(order_id): unexpected argument"),
]


@pytest.mark.parametrize(("handler", "payload", "message"), MISFITS, ids=lambda v: str(v)[:30])
def test_a_payload_that_does_not_fit_says_which_argument_and_shows_the_signature(
    handler, payload, message
):
    with pytest.raises(PayloadMismatch) as raised:
        check_arguments(handler.func, handler.name, (), payload)
    assert message in str(raised.value)


def test_positional_arguments_count_as_the_tasks_backend_passes_them():
    def add(a: int, b: int) -> int:
        return a + b

    check_arguments(add, "add", [1], {"b": 2})
    with pytest.raises(PayloadMismatch, match="3 positional arguments given, it takes 2"):
        check_arguments(add, "add", [1, 2, 3], {})
    with pytest.raises(PayloadMismatch, match="'a' is given twice"):
        check_arguments(add, "add", [1], {"a": 1, "b": 2})


def test_a_payload_that_is_not_an_object_is_refused():
    with pytest.raises(PayloadMismatch, match="must be a JSON object of keyword arguments"):
        check_arguments(tasks.noop.func, tasks.noop.name, (), [1, 2])


def test_a_callable_without_a_readable_signature_is_not_checked():
    check_arguments(max, "max", (), {"anything": 1})  # inspect.signature(max) raises


def test_a_fit_found_once_is_remembered_by_names_and_other_names_are_still_checked():
    def handler(to: str, subject: str = "") -> None: ...

    check_arguments(handler, "handler", (), {"to": "a@example.com"})
    check_arguments(handler, "handler", (), {"to": "b@example.com"})  # the same names: fits
    with pytest.raises(PayloadMismatch, match="unexpected argument 'too'"):
        check_arguments(handler, "handler", (), {"too": "a@example.com"})
    with pytest.raises(PayloadMismatch, match="missing the required argument 'to'"):
        check_arguments(handler, "handler", (), {})
    with pytest.raises(PayloadMismatch, match="'to' is given twice"):
        check_arguments(handler, "handler", [1], {"to": "a@example.com"})


def test_an_unhashable_handler_is_checked_every_time():
    class Handler:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, n: int) -> None: ...

    check_arguments(Handler(), "handler", (), {"n": 1})
    with pytest.raises(PayloadMismatch, match="unexpected argument 'm'"):
        check_arguments(Handler(), "handler", (), {"m": 1})
