"""The admin's Queues (pause, resume, per-queue limits: max_running, rate_limit) and the health
report page.

Pausing needs the pgjobs.pause_queue permission, in the list's editable column as in the
actions, which change queues through Queue.objects and log every queue they changed.
"""

from __future__ import annotations

import copy
from contextlib import suppress
from functools import cache
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, connections, router
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_pgjobs import schema
from django_pgjobs.admin import actions, charts, times
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
    list_display = ["name", "state", "paused", "max_running", "rate_limit", "updated"]
    list_editable = ["paused", "max_running", "rate_limit"]
    search_fields = ["name"]
    ordering = ["name"]
    actions = ["pause", "resume"]

    @admin.display(description=gettext_lazy("state"))
    def state(self, queue: Queue) -> str:
        """Whether workers claim the queue's jobs, in words."""
        if queue.paused:
            return _("Paused")
        if queue.max_running == 0:
            return _("Stopped (max running 0)")
        return _("Running")

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        # `paused` is the list's pause toggle. Read-only, it would be Django's boolean icon: a
        # green tick for a stopped queue; `state` says it in words.
        editable = self.has_change_permission(request)
        return [name for name in self.list_display if editable or name != "paused"]

    @admin.display(description=gettext_lazy("updated"))
    def updated(self, queue: Queue) -> SafeString | str:
        return times.ago(queue.updated_at)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("pgjobs.pause_queue")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Deleting a paused queue's row (or one of max_running 0) resumes the queue: that
        needs the permission to pause queues too (Django's "Delete selected" asks per row)."""
        if not super().has_delete_permission(request, obj):
            return False
        stopped = obj is not None and (obj.paused or obj.max_running == 0)
        return not stopped or self.has_pause_permission(request)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # The name is the row's key: changed, Django would save a copy and leave the old row.
        fields = [] if obj is None else ["name"]
        return fields if self.has_pause_permission(request) else [*fields, "paused"]

    def get_changelist_form(self, request: HttpRequest, **kwargs: Any) -> type[ModelForm]:
        form: type[ModelForm] = super().get_changelist_form(request, **kwargs)
        form = form if self.has_pause_permission(request) else _without_pause(form)
        return guarded(form)

    def save_model(self, request: HttpRequest, obj: Queue, form: Any, change: bool) -> None:
        # A queue row another session holds is waited for at most ACTION_LOCK_WAIT (MigrateFirst).
        db = router.db_for_write(Queue)
        with connections[db].cursor() as cursor:
            cursor.execute(actions.BOUND_LOCK_WAIT, [actions.ACTION_LOCK_WAIT] * 2)
        if not isinstance(form, Guarded):
            return super().save_model(request, obj, form, change)
        # Written only where the row still holds what the page showed (see Guarded): clean()
        # refused the conflicts it saw, this guard closes the moment since.
        changes = {name: form.cleaned_data[name] for name in form.changed_data}
        if changes and not Queue.objects.change(obj.pk, changes, shown=form.initial):
            obj._conflicted = True  # type: ignore[attr-defined]
            self.message_user(request, form.conflict(), messages.ERROR)

    # The changelist ignores what log_change returns.
    def log_change(  # type: ignore[override]
        self, request: HttpRequest, obj: Any, message: Any
    ) -> LogEntry | None:
        if getattr(obj, "_conflicted", False):
            return None  # not written: nothing to log
        return super().log_change(request, obj, message)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        form: type[ModelForm] = super().get_form(request, obj, change, **kwargs)
        form = form if self.has_pause_permission(request) else _without_pause(form)
        return guarded(form) if obj is not None else form  # a queue's page: as the list

    @admin.action(description=gettext_lazy("Pause selected queues"), permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        n, _seen = apply(request, queryset, QueueQuerySet.pause, CHANGE, _("Paused."))
        self.message_user(request, ngettext("%d queue paused.", "%d queues paused.", n) % n)

    @admin.action(description=gettext_lazy("Resume selected queues"), permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Queue]) -> None:
        n, _seen = apply(request, queryset, QueueQuerySet.resume, CHANGE, _("Resumed."))
        self.message_user(request, ngettext("%d queue resumed.", "%d queues resumed.", n) % n)

    # ---- the health report ---------------------------------------------------------------

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(self.report_view)
        return [path("report/", view, name="pgjobs_queue_report"), *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {
            **(extra_context or {}),
            "report_url": reverse("admin:pgjobs_queue_report"),
            # Every queue's size, age, latency and throughput, not only those with controls.
            "dashboard_url": reverse("admin:pgjobs_job_dashboard"),
        }
        return super().changelist_view(request, context)

    def _charts(self, request: HttpRequest) -> list[Any]:
        """The report page's charts; none, said, when they cannot be drawn in time."""
        try:
            return charts.windows()
        except DatabaseError as error:
            self.message_user(request, _charts_unmade(error), messages.WARNING)
            return []

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
            "charts": self._charts(request),
            "activity": reports.activity_rows(report),
            "alive": report.alive,
            "jobs_url": reverse("admin:pgjobs_job_changelist"),
            "silent": report.silent,
            "stopped": report.stopped,
            "load": report.load,
        }
        return TemplateResponse(request, "admin/pgjobs/report.html", context)


#: The list's editable columns, whose Save is judged against what the page showed.
GUARDED = ("paused", "max_running", "rate_limit")
#: The hidden input beside each of them: the value the page showed.
SHOWN = "{}-shown"


class Guarded(ModelForm):
    """A row of the Queues list whose changes are judged against the values the page showed
    (posted beside them), not the row as another operator may have changed it since. A row that
    holds neither what the page showed nor the new value is a conflict: the form says so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in GUARDED:
            if name not in self.fields:
                continue
            field = self.fields[name]
            raw = self.data.get(SHOWN.format(self.add_prefix(name))) if self.is_bound else None
            if raw is not None:  # none: a page rendered before this code; the row as it is
                # Not a value the page could have shown (a hand-made post): the row as it is.
                with suppress(forms.ValidationError):
                    self.initial[name] = field.to_python(raw)
            field.widget = _showing(field.widget, self.initial.get(name))
        if "paused" in self.fields:  # in the list, a checkbox without a label of its own
            label = _("%s paused") % self.instance.pk
            self.fields["paused"].widget.attrs.update({"aria-label": label, "title": label})

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        for name in self.changed_data:
            now = getattr(self.instance, name)  # the row as this request read it
            if name in GUARDED and now not in (self.initial.get(name), cleaned.get(name)):
                label = self.fields[name].label or name
                raise forms.ValidationError(
                    self.conflict(_(" (%(field)s is now %(now)s)") % {"field": label, "now": now}),
                    code="conflict",
                )
        return cleaned

    def conflict(self, detail: str = "") -> str:
        return _(
            "Queue %(queue)r was changed by someone else since this page was loaded%(detail)s; "
            "your change to it was not saved. Reload the page and make it again."
        ) % {"queue": self.instance.pk, "detail": detail}


def guarded(form: type[ModelForm]) -> type[Guarded]:
    """`form`, as a row of the Queues list whose Save is guarded (see Guarded)."""
    return type(f"Guarded{form.__name__}", (Guarded, form), {})


class _ShownToo:
    """A widget that also renders, hidden, the value the page showed (`shown`)."""

    shown: Any = None

    def render(self, name: str, value: Any, attrs: Any = None, renderer: Any = None) -> SafeString:
        html: SafeString = super().render(name, value, attrs, renderer)  # type: ignore[misc]
        shown = "" if self.shown is None else str(self.shown)
        hidden = format_html(
            '<input type="hidden" name="{}" value="{}">', SHOWN.format(name), shown
        )
        return html + hidden


@cache
def _showing_class(widget: type[forms.Widget]) -> type[forms.Widget]:
    return type(f"Showing{widget.__name__}", (_ShownToo, widget), {})


def _showing(widget: forms.Widget, shown: Any) -> forms.Widget:
    """A copy of `widget` that also renders the value the page showed."""
    showing = copy.copy(widget)
    showing.__class__ = _showing_class(type(widget))
    showing.shown = shown  # type: ignore[attr-defined]
    return showing


def _charts_unmade(error: DatabaseError) -> str:
    return _(
        "The charts could not be drawn within the report's time limits (%s): a day of every "
        "worker's statistics is a lot to read. PGJOBS['HEALTH']['REPORT_STATEMENT_SECONDS'] "
        "sets how long it may take, PGJOBS['STATS_RETENTION'] how much is kept."
    ) % first_line(error)


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
            if self.instance.pk is not None and self.instance.max_running == 0 and value != 0:
                raise forms.ValidationError(
                    _(
                        "This queue's max_running of 0 stops it as a pause does: changing it "
                        "resumes the queue, which needs the permission to pause queues."
                    )
                )
            return value

    return WithoutPause
