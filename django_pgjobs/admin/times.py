"""How the admin shows a moment: in the active time zone, to the second, with the zone named, and
in lists as an age ("3 min ago", "in 20 s") with the full time on hover."""

from __future__ import annotations

from datetime import UTC, datetime

from django.utils import dateformat, timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

#: The full form: to the second, 24-hour, with the zone's abbreviation.
FULL = "N j, Y, H:i:s T"


def full(value: datetime | None) -> str:
    """`value` in the active time zone, e.g. "March 2, 2026, 04:10:07 EST"; "—" for none."""
    if value is None:
        return "—"
    return dateformat.format(timezone.localtime(value), FULL)


def age(value: datetime, now: datetime | None = None) -> str:
    """How long ago `value` was ("3 min ago"), or how soon it comes ("in 20 s")."""
    seconds = ((now or timezone.now()) - value).total_seconds()
    if abs(seconds) < 1:
        return _("now")
    # The amount and its unit never part: a narrow list column breaks "10 min ago" before "ago".
    amount = span(abs(seconds)).replace(" ", "\N{NO-BREAK SPACE}")
    return (_("in %s") if seconds < 0 else _("%s ago")) % amount


def span(seconds: float) -> str:
    """A length of time in its largest whole unit: "0 s", "20 s", "3 min", "2 h", "4 days"."""
    if seconds < 60:
        return ngettext("%d s", "%d s", int(seconds)) % seconds
    if seconds < 3600:
        return ngettext("%d min", "%d min", int(seconds // 60)) % (seconds // 60)
    if seconds < 86400:
        return ngettext("%d h", "%d h", int(seconds // 3600)) % (seconds // 3600)
    return ngettext("%d day", "%d days", int(seconds // 86400)) % (seconds // 86400)


def moment(value: datetime | None) -> SafeString | str:
    """For a page: the full time, then its age."""
    if value is None:
        return "—"
    return format_html(
        '<time datetime="{}">{}</time> <span class="pgjobs-age">({})</span>',
        value.isoformat(),
        full(value),
        age(value),
    )


def ago(value: datetime | None) -> SafeString | str:
    """For a list: the age, with the full time on hover."""
    if value is None:
        return "—"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>', value.isoformat(), full(value), age(value)
    )


def recorded(text: object) -> str:
    """A time the job's history recorded as ISO 8601 text, shown as `full` (as is if it is not
    such a time)."""
    if not isinstance(text, str):
        return "" if text is None else str(text)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return text
    return full(value if timezone.is_aware(value) else value.replace(tzinfo=UTC))
