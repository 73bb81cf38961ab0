"""What a job's page shows of its batch and of the jobs and batches it waits for (after=), each
a link with its status, and which one failed: read by primary keys and the job's dependencies'
index, at most DEPENDENCIES_SHOWN of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.contrib import admin
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.admin import members
from django_pgjobs.admin.columns import STATE_FIELDS, status_text, with_clock
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.models import Batch, Dependency, Job

#: The most dependencies a job's page lists; it says how many more there are.
DEPENDENCIES_SHOWN = 50
#: The batch callbacks, by the Batch field that holds each.
CALLBACKS = ("on_complete", "on_success")
# Where a job's relations are kept on it once read, for the page's fields to share.
_KEPT = "_pgjobs_related"


@dataclass(frozen=True)
class Wait:
    """One of the jobs or batches a job waits for, as its page shows it."""

    kind: str  # "job" or "batch"
    url: str | None  # None: it is gone
    label: str
    status: str
    failed: bool  # its failure cancelled the job


@dataclass(frozen=True)
class Related:
    """A job's batch, the batch it is a callback of (and which callback), and its waits."""

    batch: Batch | None
    callback_of: tuple[Batch, str] | None
    waits: list[Wait]
    more: int  # dependencies past DEPENDENCIES_SHOWN

    def __bool__(self) -> bool:
        return bool(self.batch or self.callback_of or self.waits)


def related(job: Job) -> Related:
    """The job's relations, read once per job object (its page's fields share them)."""
    kept: Related | None = job.__dict__.get(_KEPT)
    if kept is None:
        kept = job.__dict__[_KEPT] = _read(job)
    return kept


def _read(job: Job) -> Related:
    batch = Batch.objects.filter(pk=job.batch_id).first() if job.batch_id else None
    found = list(Dependency.objects.filter(job_id=job.pk).order_by("id")[: DEPENDENCIES_SHOWN + 1])
    more = 0
    if len(found) > DEPENDENCIES_SHOWN:
        found = found[:DEPENDENCIES_SHOWN]
        more = Dependency.objects.filter(job_id=job.pk).count() - DEPENDENCIES_SHOWN
    jobs = with_clock(Job.objects.only(*STATE_FIELDS)).in_bulk(
        [d.after_job_id for d in found if d.after_job_id]
    )
    batches = Batch.objects.in_bulk([d.after_batch_id for d in found if d.after_batch_id])
    waits = [_wait(d, jobs, batches) for d in found]
    return Related(batch, _callback_of(job), waits, more)


def _wait(dependency: Dependency, jobs: dict[Any, Job], batches: dict[Any, Batch]) -> Wait:
    failed = dependency.failed
    if dependency.after_job_id is not None:
        job = jobs.get(dependency.after_job_id)
        if job is None:
            return Wait("job", None, str(dependency.after_job_id), _("deleted or pruned"), failed)
        url = reverse("admin:pgjobs_job_change", args=[job.pk])
        return Wait("job", url, f"{job.task} [{job.short_id}]", status_text(job), failed)
    batch = batches.get(dependency.after_batch_id)
    if batch is None:
        return Wait("batch", None, str(dependency.after_batch_id), _("deleted or pruned"), failed)
    url = reverse("admin:pgjobs_batch_change", args=[batch.pk])
    return Wait("batch", url, batch.short_id, members.state(batch), failed)


def _callback_of(job: Job) -> tuple[Batch, str] | None:
    """The batch whose callback this job is, and which: its payload names the batch (as every
    callback's does), and that batch's callback has the job's id."""
    payload = job.payload
    if isinstance(payload, Unreadable) or not isinstance(payload, dict):
        return None
    named = payload.get("batch")
    if not isinstance(named, dict) or not isinstance(named.get("id"), str):
        return None
    try:
        batch = Batch.objects.filter(pk=UUID(named["id"])).first()
    except ValueError:
        return None
    for name in CALLBACKS:
        spec = getattr(batch, name, None)
        if isinstance(spec, dict) and spec.get("id") == str(job.pk):
            assert batch is not None
            return batch, name
    return None


class WaitColumns:
    """The job page's fields of its batch and dependencies."""

    @admin.display(description=gettext_lazy("batch"))
    def batch_display(self, job: Job) -> SafeString | str:
        """The batch the job is a member of, or the one it is a callback of; its state."""
        found = related(job)
        if found.batch is not None:
            return _batch_link(found.batch)
        if found.callback_of is not None:
            batch, name = found.callback_of
            link = _batch_link(batch)
            return format_html(_("{callback} callback of {batch}"), callback=name, batch=link)
        if job.batch_id is not None:
            return _("batch %s (deleted or pruned)") % job.batch_id
        return "—"

    @admin.display(description=gettext_lazy("waits for"))
    def dependencies_display(self, job: Job) -> SafeString | str:
        """The jobs and batches the job waits for (after=), each with its status; the one
        whose failure cancelled it is marked."""
        found = related(job)
        if not found.waits:
            return "—"
        context = {"waits": found.waits, "more": found.more}
        return render_to_string("admin/pgjobs/dependencies.html", context)


def _batch_link(batch: Batch) -> SafeString:
    url = reverse("admin:pgjobs_batch_change", args=[batch.pk])
    return format_html('<a href="{}">{}</a> ({})', url, str(batch), members.state(batch))
