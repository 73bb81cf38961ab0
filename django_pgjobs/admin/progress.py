"""How the admin shows a job's progress report: a bar with its percentage (or, while the total is
not known, a moving bar and the count done), the note, and on the job page when it was written.
Anything that is not a report a handler could have made is shown as no report."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.utils import formats, timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext as _

from django_pgjobs.admin import times

#: How much of the note a list shows; the job page shows all of it.
NOTE_WIDTH = 30


@dataclass(frozen=True)
class Report:
    done: float
    total: float | None
    note: str
    at: datetime | None

    @property
    def percent(self) -> int | None:
        """Whole percent done, rounded down (99.9% is not shown as done); None without a total."""
        if self.total is None:
            return None
        if self.total <= self.done:
            return 100
        try:
            percent = math.floor(100 * self.done / self.total)
        except OverflowError:  # 100 * done past a float's range (a report written by hand)
            percent = math.floor(100 * (self.done / self.total))
        # Not done: never 100, even where the division rounds up to it (past a float's precision).
        return min(percent, 99)

    @property
    def count(self) -> str:
        """ "1,204 of 5,000", or "1,204 done" while the total is not known."""
        if self.total is None:
            return _("%s done") % _number(self.done)
        return _("%(done)s of %(total)s") % {
            "done": _number(self.done),
            "total": _number(self.total),
        }


def report_of(value: Any) -> Report | None:
    """The report stored in a job's `progress`, or None when there is none (or it is not one)."""
    if not isinstance(value, dict):
        return None
    done, total, note = value.get("done"), value.get("total"), value.get("note", "")
    if not _is_count(done) or not (total is None or _is_count(total)) or not isinstance(note, str):
        return None
    assert isinstance(done, int | float)
    return Report(done, total, note, _moment(value.get("at")))


def bar(report: Report) -> SafeString:
    """The bar: determinate with its percentage, or indeterminate while the total is unknown."""
    if report.percent is None:
        return format_html('<progress class="pgjobs-progress-bar">{}</progress>', report.count)
    return format_html(
        '<progress class="pgjobs-progress-bar" value="{}" max="100">{}%</progress>',
        report.percent,
        report.percent,
    )


def in_list(value: Any) -> SafeString | str:
    """For the lists' status column: the bar, the percentage (or count) and the start of the
    note, with the count and all of the note on hover."""
    report = report_of(value)
    if report is None:
        return ""
    figure = report.count if report.percent is None else f"{report.percent}%"
    hover = f"{report.count}: {report.note}" if report.note else report.count
    return format_html(
        ' <span class="pgjobs-progress" title="{}">{} <span class="pgjobs-progress-figure">{}'
        '</span> <span class="pgjobs-progress-note">{}</span></span>',
        hover,
        bar(report),
        figure,
        Truncator(report.note).chars(NOTE_WIDTH),
    )


def on_page(value: Any) -> SafeString | str:
    """For the job page: the bar, the count and percentage, all of the note, and when the report
    was written."""
    report = report_of(value)
    if report is None:
        return "—"
    figure = report.count if report.percent is None else f"{report.count} ({report.percent}%)"
    return format_html(
        '<div class="pgjobs-progress">{} <span class="pgjobs-progress-figure">{}</span></div>'
        '<div class="pgjobs-progress-note">{}</div><div class="pgjobs-age">{}</div>',
        bar(report),
        figure,
        report.note,
        format_html("{} {}", _("reported"), times.moment(report.at)) if report.at else "",
    )


def _moment(at: Any) -> datetime | None:
    """When the report was written, as an aware time the active time zone can show, else None.
    Without a zone it is UTC, as in the error history (times.recorded)."""
    if not isinstance(at, str):
        return None
    try:
        moment = datetime.fromisoformat(at)
        moment = moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)
        timezone.localtime(moment)  # past the range of datetimes there (year 1 at +14:00)
    except (ValueError, OverflowError):
        return None
    return moment


def _is_count(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int no float can hold: progress() never stores one
        return False


def _number(value: float) -> str:
    places = 0 if float(value).is_integer() else 2
    return formats.number_format(value, decimal_pos=places, use_l10n=True, force_grouping=True)
