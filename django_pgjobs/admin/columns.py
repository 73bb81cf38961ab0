"""What the job lists and the job page show of a job: status, times, progress, the last error on one
line, payload, result and history. Everything shown from job data is escaped."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.template.loader import render_to_string
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs import registry
from django_pgjobs.admin import progress, times
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.errors import UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.status import Status

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

#: How much of the last error's first line a list shows; the job page shows all of it.
ERROR_WIDTH = 80

#: The module path before an error's class name at the start of its line.
_ERROR_MODULE = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")


def status_text(job: Job) -> str:
    """The status, and whether a cancellation is under way: a running job asked to cancel is
    "cancelling" until its attempt ends."""
    if job.cancel_requested and job.status == Status.RUNNING:
        return _("cancelling")
    if job.cancel_requested and job.status == Status.SUCCEEDED:
        return _("succeeded (cancel requested)")
    return str(job.get_status_display())


@admin.display(description=gettext_lazy("status"))
def status(job: Job) -> SafeString:
    """The lists' status column (a function, so that its cells keep the class field-status); a
    running job's with its last progress report beside it (admin/progress.py)."""
    running = job.status == Status.RUNNING
    marked = "cancelling" if job.cancel_requested and running else ""
    return format_html(
        '<span class="pgjobs-status {}">{}</span>{}',
        marked,
        status_text(job),
        progress.in_list(job.progress) if running else "",
    )


@admin.display(description=gettext_lazy("task"), ordering="task")
def task(job: Job) -> SafeString:
    """The lists' task column (a function, so that its cells keep the class field-task): the
    name may break after each dot, so a long dotted path leaves room for the error column."""
    parts = re.split(r"(?<=\.)", job.task)
    return format_html_join(mark_safe("<wbr>"), "{}", ((part,) for part in parts))


def _time(
    field: str, description: StrOrPromise, shown: Callable[[datetime | None], SafeString | str]
) -> Callable[[Any, Job], SafeString | str]:
    """A display method of the job's time `field`: times.ago for a list, times.moment a page."""

    @admin.display(description=description)
    def display(self: Any, job: Job) -> SafeString | str:
        return shown(getattr(job, field))

    return display


class JobColumns:
    """The display methods of the Jobs and Dead letters admins."""

    # ---- lists -------------------------------------------------------------------------------

    @admin.display(description=gettext_lazy("id"))
    def short_id(self, job: Job) -> str:
        return job.short_id

    @admin.display(description=gettext_lazy("attempts"))
    def attempts_display(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=gettext_lazy("last error"))
    def error_line(self, job: Job) -> SafeString | str:
        """The first line of the last error, its error's class without its module path and cut
        to ERROR_WIDTH characters; all of the line (as far as the list read it) on hover."""
        # The list annotates the head of last_error and defers the column itself.
        head: str = job.error_head if hasattr(job, "error_head") else job.last_error
        line = head.split("\n", 1)[0]
        if not line:
            return ""
        # "myapp.errors.Declined: ..." as "Declined: ...", looking only at the line's start.
        short = _ERROR_MODULE.sub("", line[: 4 * ERROR_WIDTH], count=1)
        short = Truncator(short).chars(ERROR_WIDTH)
        return format_html('<span class="pgjobs-error" title="{}">{}</span>', line, short)

    @admin.display(description=gettext_lazy("final error"))
    def final_error(self, job: Job) -> SafeString | str:
        return self.error_line(job)

    due = _time("run_at", gettext_lazy("run at"), times.ago)
    created = _time("created_at", gettext_lazy("created"), times.ago)
    finished = _time("finished_at", gettext_lazy("finished"), times.ago)

    # ---- the job page ------------------------------------------------------------------------

    @admin.display(description=gettext_lazy("status"))
    def status_display(self, job: Job) -> str:
        return status_text(job)

    @admin.display(description=gettext_lazy("progress"))
    def progress_display(self, job: Job) -> SafeString | str:
        """The last progress report of the running (or last) attempt, and when it was written."""
        if isinstance(job.progress, Unreadable):
            return pretty_json(job.progress)
        return progress.on_page(job.progress)

    run_at_display = _time("run_at", gettext_lazy("run at"), times.moment)
    created_at_display = _time("created_at", gettext_lazy("created at"), times.moment)
    started_at_display = _time("started_at", gettext_lazy("started at"), times.moment)
    finished_at_display = _time("finished_at", gettext_lazy("finished at"), times.moment)
    leased_until_display = _time("leased_until", gettext_lazy("leased until"), times.moment)

    @admin.display(description=gettext_lazy("payload"))
    def payload_display(self, job: Job) -> str:
        return pretty_json(shown_payload(job))

    @admin.display(description=gettext_lazy("result"))
    def result_display(self, job: Job) -> str:
        """The handler's return value, for tasks that keep it (e.g. Django Tasks)."""
        return "—" if job.result is None else pretty_json(job.result)

    @admin.display(description=gettext_lazy("error history"))
    def error_history(self, job: Job) -> str:
        """Each failed attempt, and each replay (who, when, into which queue), oldest first."""
        if isinstance(job.errors, Unreadable):
            return pretty_json(job.errors)
        entries = [history_entry(e) for e in job.errors or []]
        return render_to_string("admin/pgjobs/error_history.html", {"entries": entries})


def history_entry(entry: Any) -> dict[str, Any]:
    """One entry of a job's history, for the template: its time in the active time zone."""
    if not isinstance(entry, dict):
        return {"message": repr(entry), "when": ""}
    if "replayed_at" in entry:
        return {**entry, "replay": True, "when": times.recorded(entry["replayed_at"])}
    return {**entry, "when": times.recorded(entry.get("at"))}


def shown_payload(job: Job) -> Any:
    """The payload with the keys its task redacts hidden."""
    if isinstance(job.payload, Unreadable):
        return job.payload
    try:
        return registry.get_task(job.task).redacted(job.payload)
    except UnknownTask:
        return job.payload


def pretty_json(value: Any) -> str:
    if isinstance(value, Unreadable):  # written by SQL or another program: said, not shown
        return format_html(
            '<pre class="pgjobs-json">{}</pre>',
            _("This JSON cannot be read in Python (%(error)s); it is kept as it is.")
            % {"error": value.error},
        )
    pretty = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('<pre class="pgjobs-json">{}</pre>', pretty)
