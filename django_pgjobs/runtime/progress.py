"""Progress reports: a running handler says how far it got, and the worker writes the latest
report with its heartbeats, at most about once a second per job (see runtime/leases.py)."""

from __future__ import annotations

import math
from decimal import Decimal
from numbers import Integral, Real
from typing import Any

from django_pgjobs import signals
from django_pgjobs.data.records import clean_text
from django_pgjobs.models import Job
from django_pgjobs.runtime.execute import current_job

#: How many characters of a note are kept; a longer one is cut, ending in "…".
NOTE_LENGTH = 200

#: How many characters of a bad value's repr an error message shows.
SHOWN_LENGTH = 40


def progress(done: float, total: float | None = None, note: str = "") -> None:
    """Report the running job's progress: `done` of `total` (None: a total not known), with a
    short `note` ("invoice 1,204", "uploading").

    Cheap enough to call for every item: it only keeps the latest report on the job in memory
    (``current_job().progress``); the worker writes it with its next round, about once a second,
    and with the job's outcome. Outside a job (a test calling the function directly) it checks
    its arguments and does nothing else. TypeError or ValueError for a report that cannot be
    shown: `done` and `total` must be finite numbers of 0 or more, `done` at most `total`, and
    `note` a str (cut to NOTE_LENGTH characters).
    """
    report = checked(done, total, note)
    job = current_job()
    if job is None:
        return
    job.progress = report
    signals.send(signals.job_progress, Job, job=job, **report)


def checked(done: Any, total: Any, note: Any) -> dict[str, Any]:
    """The report as it is stored (before the worker adds "at"); raises saying what is wrong."""
    done = _number("done", done)
    if total is not None:
        total = _number("total", total)
        if done > total:
            raise ValueError(
                f"progress(done={_shown(done)}, total={_shown(total)}): done is more than total; "
                "pass total=None while the total is not known."
            )
    if not isinstance(note, str):
        raise TypeError(f"progress(note=...) must be a str, got {type(note).__name__}.")
    # Cut before cleaning, which only ever lengthens: the same note without copying a huge one.
    note = clean_text(note[: NOTE_LENGTH + 1], NOTE_LENGTH)
    return {"done": done, "total": total, "note": note}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, Decimal)):
        raise TypeError(f"progress({name}=...) must be a number, got {type(value).__name__}.")
    number = _finite(value)
    if number is None:
        raise ValueError(f"progress({name}={_shown(value)}) must be a finite number.")
    if number < 0:
        raise ValueError(f"progress({name}={_shown(value)}) must be 0 or more.")
    return number


def _finite(value: Real | Decimal) -> float | None:
    """`value` as an int or a float; None when it is not finite, or too large for a float (no
    bar can show it)."""
    if isinstance(value, Decimal) and not value.is_finite():
        return None  # NaN, Infinity, and a signalling NaN, which float() refuses
    try:
        number = int(value) if isinstance(value, Integral) else float(value)
        return number if math.isfinite(number) else None
    except OverflowError:  # beyond a float's range
        return None


def _shown(value: Any) -> str:
    """`value` in an error message: its repr, cut to SHOWN_LENGTH characters; never an error of
    its own (an int of more digits than Python converts to text, a repr that raises)."""
    try:
        return clean_text(repr(value), SHOWN_LENGTH)
    except Exception:
        return f"<{type(value).__qualname__}>"
