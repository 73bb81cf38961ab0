"""The admin's Queues (pause, resume, per-queue limits) and the health report page.

Pausing needs the pgjobs.pause_queue permission, in the list's editable column as in the
actions; the actions change queues through Queue.objects (data/queues.py) and record every
queue they changed in Django's admin log. The report page shows what `jobstats` shows, to staff
who may view queues.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_pgjobs import schema
from django_pgjobs.admin import charts, times
from django_pgjobs.admin.actions import apply
from django_pgjobs.admin.missing import MigrateFirst
from django_pgjobs.data import rows
from django_pgjobs.data.queues import QueueQuerySet
from django_pgjobs.errors import first_line
from django_pgjobs.models import Queue
from django_pgjobs.observability import report as reports

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Queue]
    ModelForm = forms.ModelForm[Queue]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs
    ModelForm = forms.ModelForm


class QueueAdmin(MigrateFirst, ModelAdmin):
    list_display = ["name", "paused", "max_running", "updated"]
    list_editable = ["paused", "max_running"]
    search_fields = ["name"]
    ordering = ["name"]
    actions = ["pause", "resume"]

    @admin.display(description=gettext_lazy("updated"))
    def updated(self, queue: Queue) -> SafeString | str:
        return times.ago(queue.updated_at)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("pgjobs.pause_queue")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The name is the row's key: changed, Django would save a copy under the new name and
        # leave the old row, paused or limited, in place.
        fields = [] if obj is None else ["name"]
        return fields if self.has_pause_permission(request) else [*fields, "paused"]

    def get_changelist_form(self, request: HttpRequest, **kwargs: Any) -> type[ModelForm]:
        form: type[ModelForm] = super().get_changelist_form(request, **kwargs)
        return form if self.has_pause_permission(request) else _without_pause(form)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        form: type[ModelForm] = super().get_form(request, obj, change, **kwargs)
        return form if self.has_pause_permission(request) else _without_pause(form)

    @admin.action(description=gettext_lazy("Pause selected queues"), permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        count, _seen = apply(request, queryset, QueueQuerySet.pause, CHANGE, _("Paused."))
        self.message_user(request, ngettext("%d queue paused.", "%d queues paused.", count) % count)

    @admin.action(description=gettext_lazy("Resume selected queues"), permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        count, _seen = apply(request, queryset, QueueQuerySet.resume, CHANGE, _("Resumed."))
        self.message_user(
            request, ngettext("%d queue resumed.", "%d queues resumed.", count) % count
        )

    # ---- the health report ---------------------------------------------------------------

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.report_view)
        return [path("report/", view, name="pgjobs_queue_report"), *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {}), "report_url": reverse("admin:pgjobs_queue_report")}
        return super().changelist_view(request, context)

    def report_view(self, request: HttpRequest) -> HttpResponse:
        """The health report: what `jobstats` prints, for staff who may view queues."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            report = reports.collect()  # in its own transaction, with short timeouts
        except DatabaseError as error:  # what jobstats says UNKNOWN for (exit status 3)
            if schema.is_not_migrated(error):
                raise  # the "run manage.py migrate" page (MigrateFirst)
            self.message_user(request, _unreported(error), messages.ERROR)
            return HttpResponseRedirect(reverse("admin:pgjobs_queue_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Health report"),
            "report": report,
            "at": times.full(report.at),
            "vacuumed": {
                name: times.moment(getattr(report.table, name))
                for name in ("last_autovacuum", "last_vacuum", "last_autoanalyze")
            },
            "data": reports.as_dict(report),
            "charts": charts.windows(),
            "activity": reports.activity_rows(report),
            "alive": report.alive,
            "silent": report.silent,
            "stopped": report.stopped,
            "load": report.load,
        }
        return TemplateResponse(request, "admin/pgjobs/report.html", context)


def _unreported(error: DatabaseError) -> str:
    """Why the report could not be taken: the job table locked against the workers (when a
    statement ran out of time waiting for it), or the error."""
    reason = reports.locked_out() if rows.timed_out(error) else None
    if reason is not None:
        return _("The health report could not be taken: %(summary)s: %(detail)s.") % {
            "summary": reason.summary,
            "detail": reason.detail,
        }
    return _("The health report could not be taken: %s") % first_line(error)


def _without_pause(form: type[ModelForm]) -> type[ModelForm]:
    """`form` for a user who may not pause queues: `paused` shown, not changeable, and no
    max_running of 0, which stops the queue as a pause does."""

    class WithoutPause(form):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if "paused" in self.fields:
                self.fields["paused"].disabled = True

        def clean_max_running(self) -> int | None:
            value: int | None = self.cleaned_data.get("max_running")
            if value is not None and value <= 0:
                raise forms.ValidationError(
                    _(
                        "A max_running of 0 stops the queue as a pause does: it needs the "
                        "permission to pause queues."
                    )
                )
            return value

    return WithoutPause
