"""The error history's traceback (runtime/execute.failure_of) reads as Python prints it, also
when a repeated failure's stack comes from the cache."""

from __future__ import annotations

import traceback

from django_pgjobs.runtime.execute import failure_of


def _fails(n: int) -> None:
    raise RuntimeError(f"failure number {n}")


def _caught(n: int) -> BaseException:
    try:
        _fails(n)
    except RuntimeError as error:
        return error
    raise AssertionError("did not fail")


def test_a_repeated_failure_reads_as_python_prints_it_with_its_own_message():
    for n in range(3):
        error = _caught(n)
        assert failure_of(error).traceback == "".join(traceback.format_exception(error))
        assert failure_of(error).traceback.endswith(f"RuntimeError: failure number {n}\n")


def test_a_failure_elsewhere_shows_its_own_stack():
    first = _caught(1)
    try:
        raise ValueError("somewhere else")
    except ValueError as error:
        other = error
    failure_of(first)
    assert failure_of(other).traceback == "".join(traceback.format_exception(other))
    assert "_fails" not in failure_of(other).traceback


def test_a_chained_failure_shows_its_cause():
    try:
        try:
            _fails(7)
        except RuntimeError as cause:
            raise KeyError("wrapped") from cause
    except KeyError as error:
        chained = error
    text = failure_of(chained).traceback
    assert text == "".join(traceback.format_exception(chained))
    assert "failure number 7" in text and "direct cause" in text
