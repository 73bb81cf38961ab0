"""progress(): what a report may be, each bad one a specific error, and what it does outside a
job (nothing but the checks)."""

from __future__ import annotations

import decimal
import fractions
import tracemalloc

import pytest

from django_pgjobs import progress
from django_pgjobs.runtime.execute import NOTE_LENGTH, checked_progress


class Unshowable(float):
    """A number whose repr raises (a handler's own type, say)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    ("done", "total", "note", "error", "message"),
    [
        (float("nan"), None, "", ValueError, r"progress\(done=nan\) must be a finite number"),
        (1, float("inf"), "", ValueError, r"progress\(total=inf\) must be a finite number"),
        (decimal.Decimal("NaN"), None, "", ValueError, "must be a finite number"),
        (10**400, None, "", ValueError, "must be a finite number"),
        (0, fractions.Fraction(10**400), "", ValueError, "must be a finite number"),
        # What Python cannot convert or show is still our error, saying what is wrong.
        (decimal.Decimal("sNaN"), None, "", ValueError, r"done=Decimal\('sNaN'\)\) must be a fin"),
        pytest.param(
            10**5000,
            None,
            "",
            ValueError,
            r"progress\(done=<int>\) must be a finite number",
            id="an-int-of-5001-digits",
        ),
        (0, fractions.Fraction(10**5000, 3), "", ValueError, r"progress\(total=<Fraction>\) must"),
        pytest.param(
            Unshowable("inf"),
            None,
            "",
            ValueError,
            r"progress\(done=<Unshowable>\) must be",
            id="a-number-whose-repr-raises",
        ),
        (-1, None, "", ValueError, r"progress\(done=-1\) must be 0 or more"),
        (0, -5, "", ValueError, r"progress\(total=-5\) must be 0 or more"),
        (11, 10, "", ValueError, r"done=11, total=10\): done is more than total"),
        ("3", None, "", TypeError, r"progress\(done=...\) must be a number, got str"),
        (True, None, "", TypeError, "must be a number, got bool"),
        (1, [10], "", TypeError, r"progress\(total=...\) must be a number, got list"),
        (1, 10, b"bytes", TypeError, r"progress\(note=...\) must be a str, got bytes"),
        (1, 10, None, TypeError, "must be a str, got NoneType"),
    ],
)
def test_a_report_that_cannot_be_shown_is_a_specific_error(done, total, note, error, message):
    with pytest.raises(error, match=message):
        progress(done, total, note)


def test_numbers_are_kept_as_ints_or_floats():
    assert checked_progress(3, 7, "") == {"done": 3, "total": 7, "note": ""}
    report = checked_progress(decimal.Decimal("1.5"), fractions.Fraction(7, 2), "")
    assert report == {"done": 1.5, "total": 3.5, "note": ""}
    assert checked_progress(0, 0, "")["total"] == 0  # nothing to do is done
    assert checked_progress(5, None, "")["total"] is None


def test_a_long_note_is_cut_and_what_postgresql_refuses_is_replaced():
    note = checked_progress(1, None, "x" * 10_000)["note"]
    assert len(note) == NOTE_LENGTH and note.endswith("…")
    assert checked_progress(1, None, "a\x00b\ud800")["note"] == "a\\x00b\\ud800"


def test_a_huge_note_costs_no_copy_of_it():
    # Called for every item, with whatever text the handler has at hand.
    note = "x\x00" * 5_000_000  # 10 MB, with what PostgreSQL refuses
    tracemalloc.start()
    try:
        report = checked_progress(1, None, note)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report["note"] == "x\\x00" * 39 + "x\\x0…"
    assert peak < 100_000


def test_outside_a_job_it_checks_its_arguments_and_does_nothing_else():
    assert progress(1, 2, "a test calling the handler directly") is None
    with pytest.raises(ValueError, match="done is more than total"):
        progress(3, 2)
