"""Fix, then replay: correct a failed or cancelled job's payload and replay it.

For users holding pgjobs.edit_payload_job and pgjobs.replay_job. The new payload is checked as
enqueue and a worker check it; nothing is written unless it passes. Redacted keys keep their
stored value unless replaced. The change and the replay are one transaction, logged with the
payload before and after (redacted).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import router, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs import registry, validation
from django_pgjobs.admin.actions import handed
from django_pgjobs.admin.columns import shown_payload
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.errors import EnqueueError, PayloadMismatch, UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.transports import nats_queues

if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Job]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs

REDACTED = "[redacted]"
#: The statuses whose payload may be corrected: those replay takes.
EDITABLE = (Status.FAILED, Status.CANCELLED)


def applies(job: Job) -> bool:
    return job.status in EDITABLE


def refused(job: Job) -> str | None:
    """Why this job's payload cannot be edited though its status allows it, or None."""
    try:
        registry.get_task(job.task)
    except UnknownTask:
        return _("The task %s is not registered here, so its payload cannot be checked.") % job.task
    return None


class PayloadForm(forms.Form):
    payload = forms.CharField(
        label=gettext_lazy("Payload"),
        widget=forms.Textarea(attrs={"rows": 14, "cols": 80, "spellcheck": "false"}),
        help_text=gettext_lazy(
            "A JSON object: the handler's keyword arguments. Keys shown as “[redacted]” keep "
            "their stored value unless you replace it."
        ),
    )

    def __init__(self, job: Job, data: Any = None) -> None:
        self.job = job
        shown = json.dumps(shown_payload(job), indent=2, sort_keys=True, ensure_ascii=False)
        super().__init__(data, initial={"payload": shown})

    def clean_payload(self) -> dict[str, Any]:
        try:
            payload = json.loads(self.cleaned_data["payload"], parse_constant=_no_constant)
        except ValueError as error:
            raise ValidationError(_("Not valid JSON: %s") % error) from None
        payload = self.unredacted(payload)
        if why := refused(self.job):  # unregistered since the page was shown
            raise ValidationError(why)
        task = registry.get_task(self.job.task)
        try:
            validation.payload_json(payload, get_settings().MAX_PAYLOAD_BYTES)  # as enqueue
            check_arguments(task.func, task.name, (), payload)
        except (EnqueueError, PayloadMismatch) as error:
            raise ValidationError(str(error)) from None
        return payload  # type: ignore[no-any-return]

    def unredacted(self, payload: Any) -> Any:
        """The edited payload, with the stored value of each redacted key left as shown."""
        stored = self.job.payload
        if not (isinstance(payload, dict) and isinstance(stored, dict)):
            return payload
        return {
            key: stored[key] if value == REDACTED and key in stored else value
            for key, value in payload.items()
        }


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def edit_payload_view(model_admin: Any, request: HttpRequest, object_id: str) -> HttpResponse:
    """The page: the payload to correct, then (in one transaction) the change and the replay."""
    job: Job | None = model_admin.get_object(request, object_id)
    if job is None:
        return model_admin._get_obj_does_not_exist_redirect(  # type: ignore[no-any-return]
            request, model_admin.opts, object_id
        )
    if not may_edit(model_admin, request, job):
        raise PermissionDenied
    page = reverse(model_admin.url_name("change"), args=[job.pk])
    if isinstance(job.payload, Unreadable):
        model_admin.message_user(
            request,
            _("This job's payload cannot be read in Python (%(error)s): correct it in SQL, or "
              "delete the job.") % {"error": job.payload.error},
            messages.ERROR,
        )  # fmt: skip
        return HttpResponseRedirect(page)
    if not applies(job):
        model_admin.message_user(
            request, _("Only a failed or cancelled job's payload can be edited."), messages.ERROR
        )
        return HttpResponseRedirect(page)
    if why := refused(job):
        model_admin.message_user(request, why, messages.ERROR)
        return HttpResponseRedirect(page)
    form = PayloadForm(job, request.POST if request.method == "POST" else None)
    stored = _compact(job.payload)
    if request.method == "POST" and form.is_valid() and fix_and_replay(request, job, form):
        if _compact(job.payload) == stored:  # saved as it was: say so, not "changed"
            said = _("The job replayed, its payload unchanged.")
        else:
            said = _("Payload changed, and the job replayed.")
        nats = nats_queues().get(job.queue)
        if nats is not None:  # its row goes once relayed: no page to show
            model_admin.message_user(request, said + handed([nats.stream]))
            return HttpResponseRedirect(reverse("admin:pgjobs_job_changelist"))
        model_admin.message_user(request, said)
        # The job's page under Jobs: a replayed job is no longer a dead letter.
        return HttpResponseRedirect(reverse("admin:pgjobs_job_change", args=[job.pk]))
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": _("Edit the payload, then replay"),
        "original": job,
        "form": form,
        "cancel_url": page,
    }
    return TemplateResponse(request, "admin/pgjobs/edit_payload.html", context)


def may_edit(model_admin: Any, request: HttpRequest, job: Job | None = None) -> bool:
    return bool(
        model_admin.has_view_permission(request, job)
        and model_admin.has_replay_permission(request)
        and model_admin.has_edit_payload_permission(request)
    )


def fix_and_replay(request: HttpRequest, job: Job, form: PayloadForm) -> bool:
    """Change the payload and replay the job, both or neither; False (with the form told why)
    when replay would not take the job."""
    payload = form.cleaned_data["payload"]
    selected = Job.objects.filter(pk=job.pk)
    user = request.user
    with transaction.atomic(using=router.db_for_write(Job)):
        logged = Job.objects.only("id", "task", "status").get(pk=job.pk)  # as it was
        before = shown_payload(job)
        replayed = selected.replace_payload(payload) and selected.replay(by=user.get_username())
        if not replayed:
            transaction.set_rollback(True)
            form.add_error(
                None,
                _(
                    "Nothing changed: the job was not replayed (only failed or cancelled jobs "
                    "are, and of a unique key only the oldest, while no live job holds it)."
                ),
            )
            return False
        job.payload = payload
        message = _("Payload edited, then replayed. Before: %(before)s After: %(after)s") % {
            "before": _compact(before),
            "after": _compact(shown_payload(job)),
        }
        assert user.pk is not None
        LogEntry.objects.log_actions(user.pk, [logged], CHANGE, message)
    return True


def _compact(payload: Any) -> str:
    return json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))
