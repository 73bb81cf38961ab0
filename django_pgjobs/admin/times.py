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
    amount = abs(seconds)
    if amount < 1:
        return _("now")
    if amount < 60:
        span = ngettext("%d s", "%d s", int(amount)) % amount
    elif amount < 3600:
        span = ngettext("%d min", "%d min", int(amount // 60)) % (amount // 60)
    elif amount < 86400:
        span = ngettext("%d h", "%d h", int(amount // 3600)) % (amount // 3600)
    else:
        span = ngettext("%d day", "%d days", int(amount // 86400)) % (amount // 86400)
    return (_("in %s") if seconds < 0 else _("%s ago")) % span


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
