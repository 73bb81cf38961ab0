"""The admin's Batches: each batch's progress, its members counted by status (each count a link
to them in Jobs), its callbacks, and "Replay failed members".

Read-only, and answered with the Job permissions: a batch's page shows jobs, and its one action
is the Jobs list's Replay, on the batch's failed and cancelled members.
"""

from __future__ import annotations

from contextlib import suppress
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.admin import members, progress, times
from django_pgjobs.admin.actions import REPLAY, perform
from django_pgjobs.admin.columns import STATE_FIELDS, pretty_json, status_text, with_clock
from django_pgjobs.admin.jobs import JobPermissions
from django_pgjobs.admin.lists import EstimatedCountPaginator
from django_pgjobs.admin.missing import MigrateFirst
from django_pgjobs.models import Batch, Job

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Batch]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs

# Where a batch's callback jobs are kept on it once read, for the page's fields to share.
_CALLBACK_JOBS = "_pgjobs_callback_jobs"


class StateFilter(admin.SimpleListFilter):
    """Open, completed without succeeding (failed or cancelled jobs to replay), or succeeded:
    the first two through pgjobs_batch_open_idx."""

    title = gettext_lazy("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("open", gettext_lazy("open")),
            ("completed", gettext_lazy("completed, not succeeded")),
            ("succeeded", gettext_lazy("succeeded")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "open":
            return queryset.filter(succeeded_at__isnull=True, completed_at__isnull=True)
        if value == "completed":
            return queryset.filter(succeeded_at__isnull=True, completed_at__isnull=False)
        if value == "succeeded":
            return queryset.filter(succeeded_at__isnull=False)
        return queryset


class BatchChangeList(ChangeList):
    def get_results(self, request: HttpRequest) -> None:
        """Django's, then the page's batches' live members counted in one statement (their
        progress)."""
        super().get_results(request)
        members.keep(list(self.result_list))


class BatchAdmin(MigrateFirst, JobPermissions, ModelAdmin):
    list_display = ["short_id", "created", "size", "progress", "completed", "succeeded"]
    list_display_links = ["short_id"]
    list_filter = [StateFilter]
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    sortable_by = ()  # newest first (ids are UUIDv7s): other orders would sort the table
    ordering = ("-id",)
    # The box is shown when search_fields is set; get_search_results does the searching.
    search_fields = ("id",)
    search_help_text = gettext_lazy("A batch's id.")
    actions = None
    fieldsets = [
        (None, {"fields": [
            "id", "created_at_display", "size", "state", "progress_display",
            "completed_at_display", "succeeded_at_display",
        ]}),
        (gettext_lazy("Jobs"), {"fields": ["members_display"]}),
        (gettext_lazy("Callbacks"), {"fields": ["on_complete_display", "on_success_display"]}),
    ]  # fmt: skip
    readonly_fields = [
        "id", "created_at_display", "size", "state", "progress_display", "completed_at_display",
        "succeeded_at_display", "members_display", "on_complete_display", "on_success_display",
    ]  # fmt: skip

    # ---- permissions: the Job model's (JobPermissions); batches change only with their jobs --

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # ---- list --------------------------------------------------------------------------------

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return BatchChangeList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Batch], search_term: str
    ) -> tuple[QuerySet[Batch], bool]:
        """A batch's full id (its primary key); anything else finds none."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            return queryset.filter(pk=UUID(term)), False
        except ValueError:
            return queryset.none(), False

    @admin.display(description=gettext_lazy("id"))
    def short_id(self, batch: Batch) -> str:
        return batch.short_id

    @admin.display(description=gettext_lazy("created"))
    def created(self, batch: Batch) -> SafeString | str:
        return times.ago(batch.created_at)

    @admin.display(description=gettext_lazy("progress"))
    def progress(self, batch: Batch) -> SafeString | str:
        """The share of its jobs finished, with how many failed and were cancelled when it
        completed."""
        return progress.in_list(_report(batch))

    @admin.display(description=gettext_lazy("completed"))
    def completed(self, batch: Batch) -> SafeString | str:
        return times.ago(batch.completed_at)

    @admin.display(description=gettext_lazy("succeeded"))
    def succeeded(self, batch: Batch) -> SafeString | str:
        return times.ago(batch.succeeded_at)

    # ---- the batch's page --------------------------------------------------------------------

    @admin.display(description=gettext_lazy("created at"))
    def created_at_display(self, batch: Batch) -> SafeString | str:
        return times.moment(batch.created_at)

    @admin.display(description=gettext_lazy("completed at"))
    def completed_at_display(self, batch: Batch) -> SafeString | str:
        """When its last job finished, and on_complete was enqueued."""
        return times.moment(batch.completed_at)

    @admin.display(description=gettext_lazy("succeeded at"))
    def succeeded_at_display(self, batch: Batch) -> SafeString | str:
        """When its last job succeeded, and on_success was enqueued: maybe after replays."""
        return times.moment(batch.succeeded_at)

    @admin.display(description=gettext_lazy("state"))
    def state(self, batch: Batch) -> str:
        return members.state(batch)

    @admin.display(description=gettext_lazy("progress"))
    def progress_display(self, batch: Batch) -> SafeString | str:
        return progress.on_page(_report(batch, outcome=False))  # the state says it

    @admin.display(description=gettext_lazy("jobs by status"))
    def members_display(self, batch: Batch) -> SafeString:
        """Each status's count, a link to those jobs in the Jobs list."""
        counted = members.of(batch)
        rows = [
            {
                "status": status.value,
                "label": status.label,
                "count": counted[status],
                "url": members.jobs_url(batch, status),
            }
            for status in members.ORDER
        ]
        context = {"rows": rows, "gone": counted.gone, "all_url": members.jobs_url(batch)}
        return render_to_string("admin/pgjobs/batch/members.html", context)

    @admin.display(description=gettext_lazy("on complete"))
    def on_complete_display(self, batch: Batch) -> SafeString | str:
        return self.callback(batch, "on_complete")

    @admin.display(description=gettext_lazy("on success"))
    def on_success_display(self, batch: Batch) -> SafeString | str:
        return self.callback(batch, "on_success")

    def callback(self, batch: Batch, name: str) -> SafeString | str:
        """The callback's task, and its job (a link, with its status) once enqueued."""
        spec = getattr(batch, name)
        if spec is None:
            return "—"
        if not isinstance(spec, dict) or not isinstance(spec.get("task"), str):
            return pretty_json(spec)  # not as batch() writes one: shown as it is
        job = _callback_jobs(batch).get(str(spec.get("id")))
        if job is not None:
            url = reverse("admin:pgjobs_job_change", args=[job.pk])
            return format_html(
                '<code>{}</code>: <a href="{}">{}</a> ({})',
                spec["task"],
                url,
                job.short_id,
                status_text(job),
            )
        moved = batch.completed_at if name == "on_complete" else batch.succeeded_at
        if moved is not None:
            why = _("enqueued, since pruned or deleted")
        elif name == "on_complete":
            why = _("enqueued once every job has finished")
        else:
            why = _("enqueued once every job has succeeded")
        return format_html("<code>{}</code>: {}", spec["task"], why)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        """Django's, with "Replay failed members" for a batch that has some, to users who may
        replay."""
        if isinstance(obj, Batch) and self.may_replay(request) and members.of(obj).replayable:
            context["replay_failed_url"] = reverse(self.url_name("replay_failed"), args=[obj.pk])
        return super().render_change_form(request, context, add, change, form_url, obj)

    # ---- replay failed members ---------------------------------------------------------------

    def may_replay(self, request: HttpRequest) -> bool:
        """As the Jobs list's Replay: who may view jobs and replay them."""
        return self.has_view_permission(request) and self.has_replay_permission(request)

    def url_name(self, view: str) -> str:
        return f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self) -> list[Any]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        view = self.admin_site.admin_view(self.replay_failed_view)
        return [
            path("<path:object_id>/replay-failed/", view, name=f"{prefix}_replay_failed"),
            *super().get_urls(),
        ]

    def replay_failed_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Replay the batch's failed and cancelled members: Replay's confirmation page (count,
        queue), then Replay itself, logged job by job."""
        if not self.may_replay(request):
            raise PermissionDenied
        batch = self.get_object(request, unquote(object_id))
        if batch is None:
            # Django's answer to a page of a missing object (not in the type stubs).
            gone: HttpResponse = self._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined]
                request, self.opts, object_id
            )
            return gone
        page = reverse(self.url_name("change"), args=[batch.pk])
        failed = Job.objects.filter(batch=batch, status__in=members.REPLAYABLE)
        response = perform(self, request, failed, REPLAY, cancel_url=page)
        if isinstance(response, TemplateResponse):
            response.context_data = {
                **(response.context_data or {}),
                "title": _("Replay the failed jobs of %s") % batch,
            }
        return response or HttpResponseRedirect(page)


def _report(batch: Batch, outcome: bool = True) -> dict[str, Any]:
    """The batch's progress as a progress report (admin/progress.py draws it): its jobs done of
    its size, and (`outcome`) how many failed and were cancelled when it completed."""
    done = members.of(batch).done
    note = ""
    if outcome and batch.completed_at is not None and batch.succeeded_at is None:
        note = _("completed with %(failed)s failed, %(cancelled)s cancelled") % {
            "failed": batch.failed,
            "cancelled": batch.cancelled,
        }
    if done.estimated:
        note = " ".join(filter(None, [_("(about)"), note]))
    return {"done": done.n, "total": batch.size, "note": note}


def _callback_jobs(batch: Batch) -> dict[str, Job]:
    """The batch's callback jobs that exist, by id as text, read once per batch object."""
    kept: dict[str, Job] | None = batch.__dict__.get(_CALLBACK_JOBS)
    if kept is None:
        ids = []
        for spec in (batch.on_complete, batch.on_success):
            if isinstance(spec, dict):
                with suppress(ValueError):  # not as batch() writes one: no job to look for
                    ids.append(UUID(str(spec.get("id"))))
        found = with_clock(Job.objects.only(*STATE_FIELDS)).in_bulk(ids)
        kept = batch.__dict__[_CALLBACK_JOBS] = {str(pk): job for pk, job in found.items()}
    return kept
