"""The admin of periodic schedules: read-only, with each schedule's last and next tick."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_pgjobs import periodic
from django_pgjobs.admin import times
from django_pgjobs.admin.missing import MigrateFirst
from django_pgjobs.cron import next_tick
from django_pgjobs.models import Schedule

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Schedule]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs


class ScheduleAdmin(MigrateFirst, ModelAdmin):
    """Schedules are declared in code and settings, so nothing here changes them."""

    list_display = ("name", "task", "cron", "timezone", "last", "next", "declared")
    search_fields = ("name", "task")
    ordering = ("name",)
    fields = ("name", "task", "cron", "timezone", "last", "next", "declared")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False

    @admin.display(description=_("last tick"))
    def last(self, schedule: Schedule) -> SafeString | str:
        """The last tick handled, in the active time zone (cron reads the schedule's own)."""
        return times.moment(schedule.last_tick)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        # The database's clock, which workers judge ticks by, read with the rows.
        return super().get_queryset(request).annotate(now=Now())

    @admin.display(description=_("next tick"))
    def next(self, schedule: Schedule) -> SafeString | str:
        """When a worker will next enqueue it, in the active time zone; "—" for a schedule no
        longer declared. Overdue, said so, when it passed on the database's clock: no worker
        enqueued it."""
        tick = self.next_tick(schedule)
        if tick is not None and tick < schedule.now:  # type: ignore[attr-defined]
            overdue = gettext("<strong>Overdue</strong> since {}: no worker has enqueued it.")
            return format_html(overdue, times.moment(tick))
        return times.moment(tick)

    def next_tick(self, schedule: Schedule) -> datetime | None:
        """When a worker will next enqueue it; none for a schedule no longer declared."""
        if not self.declared(schedule):
            return None
        try:
            return next_tick(schedule.cron, ZoneInfo(schedule.timezone), schedule.last_tick)
        except (ValueError, KeyError):
            return None

    @admin.display(description=_("declared"), boolean=True)
    def declared(self, schedule: Schedule) -> bool:
        """Whether the settings and tasks still declare it, in a form workers can schedule
        (they ignore other rows, and do not start with a declaration they cannot read)."""
        return schedule.name in {each.name for each in periodic.declared()[0]}
