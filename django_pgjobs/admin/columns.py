"""What the job lists and the job page show of a job: status, times, progress, the last error on one
line, payload, result and history. Everything shown from job data is escaped.

A running job whose lease ran out is shown as stuck, judged by the database's clock as the job
was read (with_clock), never the app's: leases are written and reaped on that clock."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_pgjobs import registry
from django_pgjobs.admin import progress, times
from django_pgjobs.conf import get_settings
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


#: The fields status_text reads: a page that shows other jobs' status reads only these.
STATE_FIELDS = ("id", "task", "status", "cancel_requested", "leased_until")


def with_clock(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """`jobs`, each read with the database's clock (`db_now`), by which stuck_for judges it."""
    return jobs.annotate(db_now=Now())


def stuck_for(job: Job) -> timedelta | None:
    """How long ago a running job's lease ran out: its worker stopped heartbeating. None when
    it is not stuck, or was read without the database's clock (with_clock)."""
    now: datetime | None = getattr(job, "db_now", None)
    if job.status != Status.RUNNING or now is None or job.leased_until is None:
        return None
    return now - job.leased_until if job.leased_until < now else None


def stuck_note(job: Job, overdue: timedelta) -> str:
    return _(
        "Its worker (%(worker)s) stopped heartbeating: its lease ran out %(ago)s ago. Any running "
        "worker takes the job back at its next reap, within seconds."
    ) % {"worker": job.worker, "ago": times.span(overdue.total_seconds())}


def status_text(job: Job) -> str:
    """The status, and whether a cancellation is under way: a running job asked to cancel is
    "cancelling" until its attempt ends; one whose lease ran out is "stuck"."""
    if stuck_for(job) is not None:
        return _("stuck")
    if job.cancel_requested and job.status == Status.RUNNING:
        return _("cancelling")
    if job.cancel_requested and job.status == Status.SUCCEEDED:
        return _("succeeded (cancel requested)")
    return str(job.get_status_display())


@admin.display(description=gettext_lazy("status"))
def status(job: Job) -> SafeString:
    """The lists' status column (a function, so that its cells keep the class field-status); a
    running job's with its last progress report beside it (admin/progress.py), but a stuck
    one's, whose report no longer moves: why it is stuck, on hover."""
    overdue = stuck_for(job)
    if overdue is not None:
        return format_html(
            '<span class="pgjobs-status stuck" title="{}">{}</span>',
            stuck_note(job, overdue),
            status_text(job),
        )
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
    def status_display(self, job: Job) -> SafeString | str:
        overdue = stuck_for(job)
        if overdue is None:
            return status_text(job)
        return format_html(
            '<strong class="pgjobs-status stuck">{}</strong><div class="pgjobs-age">{}</div>',
            status_text(job),
            stuck_note(job, overdue),
        )

    @admin.display(description=gettext_lazy("progress"))
    def progress_display(self, job: Job) -> SafeString | str:
        """The last progress report of the running (or last) attempt, and when it was written;
        a stuck job's greyed, as it no longer moves."""
        if isinstance(job.progress, Unreadable):
            return pretty_json(job.progress)
        if stuck_for(job) is not None and progress.report_of(job.progress) is not None:
            return format_html(
                '<div class="pgjobs-stalled">{}</div><div class="pgjobs-age">{}</div>',
                progress.on_page(job.progress),
                _("No report since its worker stopped heartbeating."),
            )
        return progress.on_page(job.progress)

    @admin.display(description=gettext_lazy("time spent"))
    def time_spent(self, job: Job) -> SafeString | str:
        rows = spent(job)
        if not rows:
            return "—"
        return format_html_join("", '<div class="pgjobs-spent"><strong>{}</strong> {}</div>', rows)

    @admin.display(description=gettext_lazy("worker"))
    def worker_display(self, job: Job) -> SafeString | str:
        """The worker that claimed the job last, and a link to the jobs it holds now."""
        if not job.worker:
            return "—"
        url = f"{reverse('admin:pgjobs_job_changelist')}?{urlencode({'worker': job.worker})}"
        return format_html('{} · <a href="{}">{}</a>', job.worker, url, _("the jobs it holds"))

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
        kept = get_settings().ERRORS_KEPT
        # Each failure and each replay adds an entry, and only the last `kept` stay: a replay
        # after five failed attempts drops attempt 1.
        trimmed = len(entries) >= kept
        return render_to_string(
            "admin/pgjobs/error_history.html",
            {"entries": entries, "trimmed": trimmed, "kept": kept},
        )


def spent(job: Job) -> list[tuple[str, str]]:
    """Where the job's time went, from its own timestamps: waiting once due, running, its
    retries and their backoff, and in all; "now" is the database's clock as it was read."""
    now: datetime | None = getattr(job, "db_now", None)
    if now is None:  # read without the database's clock (with_clock): nothing to measure to
        return []
    end = job.finished_at or now
    so_far = _("so far") if job.finished_at is None else ""
    # started_at is the latest claim's: this attempt's while it runs, else only if it came
    # after run_at (a retry or a replay moves run_at on, and the next claim started_at).
    started = job.started_at
    if started is not None and job.status != Status.RUNNING and started < job.run_at:
        started = None
    rows = []
    if started is not None:
        rows.append((_("waited"), _("%s from due to started") % _span(started, job.run_at)))
        rows.append((_("ran"), f"{_span(end, started)} {so_far}".strip()))
    elif job.status == Status.READY and job.run_at <= now:
        rows.append((_("waited"), _("%s since due, not started yet") % _span(now, job.run_at)))
    elif job.status == Status.READY:
        rows.append((_("waited"), _("not due yet: due in %s") % _span(job.run_at, now)))
    retries = job.attempts - 1 if started is not None else job.attempts
    if retries > 0:
        backoff = _last_backoff(job, retries)
        said = ngettext("%d time", "%d times", retries) % retries
        if backoff is not None:
            said += _("; a backoff of %s after the last") % backoff
        rows.append((_("retried"), said))
    rows.append((_("in all"), f"{_span(end, job.created_at)} {so_far}".strip()))
    return rows


def _span(later: datetime, earlier: datetime) -> str:
    return times.span(max((later - earlier).total_seconds(), 0.0))


def _last_backoff(job: Job, attempt: int) -> str | None:
    """How long the job waited after attempt `attempt` failed: from that failure, as the
    history recorded it, to the run_at it was given. None if the history does not say."""
    entries = job.errors if isinstance(job.errors, list) else []
    for entry in reversed(entries):
        if isinstance(entry, dict) and "replayed_at" in entry:
            return None  # attempts count from 1 again after a replay: not this cycle's
        if isinstance(entry, dict) and entry.get("attempt") == attempt:
            try:
                failed = datetime.fromisoformat(str(entry.get("at")))
            except ValueError:
                return None
            return _span(job.run_at, failed) if timezone.is_aware(failed) else None
    return None


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
