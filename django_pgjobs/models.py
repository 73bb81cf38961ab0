"""The tables: Job (one row per job, its statuses, constraints and indexes), the queues' controls,
workers' statistics, and the periodic schedules' last ticks."""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.checks import CheckMessage
from django.db import connections, models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.queues import QueueQuerySet
from django_pgjobs.data.sql import CLAIM_ORDER
from django_pgjobs.ids import uuid7
from django_pgjobs.limits import validate_rate
from django_pgjobs.status import FINISHED, HOLDS_KEY, LIVE, Status
from django_pgjobs.validation import MAX_PRIORITY, MIN_PRIORITY

#: The columns a worker writes while it holds a claim (Job.save refuses them then).
WORKER_FIELDS = frozenset({
    "status", "attempts", "claims", "worker", "leased_until", "run_at", "scheduled",
    "started_at", "finished_at", "last_error", "errors", "result", "progress",
    "cancel_requested",
})  # fmt: skip


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    queue = models.CharField(max_length=100)
    task = models.CharField(max_length=200)
    payload = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, db_default=Status.READY)
    priority = models.SmallIntegerField(default=0, db_default=0)
    run_at = models.DateTimeField(db_default=Now())
    attempts = models.IntegerField(default=0, db_default=0)
    max_attempts = models.IntegerField()
    leased_until = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=200, null=True, blank=True)
    last_error = models.TextField(blank=True, default="", db_default="")
    errors = models.JSONField(default=list, db_default=[], blank=True)
    created_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    unique_key = models.CharField(max_length=200, null=True, blank=True)
    #: When the current (or last) attempt was claimed; with run_at, the claim latency.
    started_at = models.DateTimeField(null=True, blank=True)
    #: Someone asked to cancel this job while it ran; its handler may notice and stop.
    cancel_requested = models.BooleanField(default=False, db_default=False)
    #: The handler's return value, for tasks that keep it (e.g. Django Tasks' results).
    result = models.JSONField(null=True, blank=True)
    #: How many times the job was claimed, never reset (not even by replay): the fencing token
    #: every write of a worker's outcome is guarded on, so a stale claim cannot overwrite it.
    claims = models.IntegerField(default=0, db_default=0)
    #: A ready job not yet due when last written: it waits in pgjobs_job_scheduled_idx, out of
    #: the claim index's way whatever its priority, until workers move it there (data/sql.py).
    scheduled = models.BooleanField(default=False, db_default=False)
    #: The handler's last progress report ({"done", "total", "note", "at"}), unindexed to stay HOT.
    progress = models.JSONField(null=True, blank=True)
    #: Context carried from the enqueue, as message headers are (e.g. a W3C `traceparent`).
    headers = models.JSONField(null=True, blank=True)
    #: The job's task has limits (@task rate_limit, concurrency_limit, limit_by): the value
    #: they are held per ("" for the whole task). Such jobs wait in an index of their own, by
    #: task and key, out of the claim index's way, and are claimed a key at a time (limits.py).
    limit_key = models.CharField(max_length=200, null=True, blank=True, editable=False)
    #: The batch the job was enqueued in (django_pgjobs.batch): no constraint, so that a
    #: member's insert and settle never touch the batch's row (batches.py); indexed by
    #: pgjobs_job_batch_idx, which holds only the jobs of a batch.
    batch = models.ForeignKey(
        "Batch", null=True, blank=True, editable=False, db_constraint=False, db_index=False,
        on_delete=models.DO_NOTHING, related_name="jobs",
    )  # fmt: skip

    objects: ClassVar[JobManager] = JobManager()

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        permissions = [
            ("replay_job", _("Can replay failed or cancelled jobs")),
            ("cancel_job", _("Can cancel jobs")),
            ("edit_payload_job", _("Can edit a failed or cancelled job's payload before replay")),
        ]
        indexes = [
            # Due jobs in claim order: a claim is a range scan that stops after its batch.
            models.Index(
                fields=["queue", *CLAIM_ORDER],
                name="pgjobs_job_claim_idx",
                condition=Q(status=Status.READY, scheduled=False, limit_key__isnull=True),
            ),
            # Due jobs of limited tasks, by task and key, each key's in claim order: a claim
            # finds the keys with due jobs by skipping from one to the next (data/sql.py).
            models.Index(
                fields=["queue", "task", "limit_key", *CLAIM_ORDER],
                name="pgjobs_job_keyed_idx",
                condition=Q(status=Status.READY, scheduled=False, limit_key__isnull=False),
            ),
            # How many of a key's jobs run: a concurrency limit counts them at each claim.
            models.Index(
                fields=["task", "limit_key"],
                name="pgjobs_job_keyed_running_idx",
                condition=Q(status=Status.RUNNING, limit_key__isnull=False),
            ),
            # Jobs waiting for their run_at, by run_at: the due ones come first.
            models.Index(
                fields=["run_at"],
                include=["queue"],
                name="pgjobs_job_scheduled_idx",
                condition=Q(status=Status.READY, scheduled=True),
            ),
            # The reaper's index, keyed on `worker` so that a heartbeat can be a HOT update.
            models.Index(
                fields=["worker"],
                name="pgjobs_job_running_idx",
                condition=Q(status=Status.RUNNING),
            ),
            # The admin's search and filter by task: a rare task's jobs without reading the table.
            models.Index(fields=["task"], name="pgjobs_job_task_idx"),
            # A batch's members by status: "is any still live?" is one probe (batches.py).
            models.Index(
                fields=["batch", "status"],
                name="pgjobs_job_batch_idx",
                condition=Q(batch__isnull=False),
            ),
            # Jobs waiting for their dependencies (after=), for jobstats and the admin's filter.
            models.Index(
                fields=["id"], name="pgjobs_job_waiting_idx", condition=Q(status=Status.WAITING)
            ),
            # Dead letters, newest first, without scanning the finished history; counted by queue
            # and task from the index alone (the report, the dashboard).
            models.Index(
                fields=["-id"],
                include=["queue", "task"],
                name="pgjobs_job_dead_idx",
                condition=Q(status=Status.FAILED),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=Status.values), name="pgjobs_job_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=MIN_PRIORITY, priority__lte=MAX_PRIORITY),
                name="pgjobs_job_priority_range",
            ),
            models.CheckConstraint(
                condition=Q(attempts__gte=0) & Q(max_attempts__gte=1),
                name="pgjobs_job_attempts_valid",
            ),
            models.CheckConstraint(
                condition=~Q(status=Status.RUNNING) | Q(leased_until__isnull=False),
                name="pgjobs_job_running_has_lease",
            ),
            models.CheckConstraint(
                condition=Q(status__in=FINISHED, finished_at__isnull=False)
                | Q(status__in=LIVE, finished_at__isnull=True),
                name="pgjobs_job_finished_iff_finished_at",
            ),
            # Only rows that have a key: most have none, and each entry costs at insert and claim.
            models.UniqueConstraint(
                fields=["unique_key"],
                condition=Q(status__in=HOLDS_KEY, unique_key__isnull=False),
                name="pgjobs_job_unique_key_live",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task} [{self.short_id}] {self.status}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """As Django's, but a stored job is saved by the fields that changed (`update_fields`).

        A whole-row save would write back the status, claims and lease as this object last read
        them, over what workers wrote since (a finished job would run again); and a running
        job's worker columns (WORKER_FIELDS) are its worker's alone."""
        fields = kwargs.get("update_fields")
        loaded = self.__dict__  # read without loading what a deferred query left out
        if (
            not self._state.adding
            and loaded.get("status") == Status.RUNNING
            and loaded.get("worker")
        ):
            owned = sorted(WORKER_FIELDS & set(fields)) if fields is not None else None
            if owned is None or owned:
                raise ValueError(
                    f"job {self.pk} is running on a worker, which alone writes "
                    f"{', '.join(owned or sorted(WORKER_FIELDS))}: save only the fields you "
                    "changed, e.g. current_job().save(update_fields=['payload'])"
                )
        elif (
            fields is None
            and not self._state.adding
            and self.pk is not None  # a copy: saved as a new row
            and not self.get_deferred_fields() >= WORKER_FIELDS  # .only(): its fields alone
        ):
            raise ValueError(
                f"job {self.pk} is stored: save only the fields you changed, e.g. "
                "job.save(update_fields=['priority']). A save of the whole row would write "
                "back its status, attempts, claims and lease as this object last read them, "
                "over what workers wrote since (a finished job would run again). A job's state "
                "changes through its queryset: Job.objects.filter(pk=job.pk).cancel(), "
                ".replay(), .run_now()."
            )
        super().save(*args, **kwargs)

    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        """Django's checks of the model, less its warnings that another database lacks a
        feature of these indexes: pgjobs.E001 says once that it cannot hold the queue."""
        messages: list[CheckMessage] = super().check(**kwargs)
        databases = kwargs.get("databases") or ()
        if all(connections[db].vendor == "postgresql" for db in databases):
            return messages
        return [message for message in messages if message.id not in _UNSUPPORTED_FEATURE]

    @property
    def short_id(self) -> str:
        return self.id.hex[-12:]


#: Django's warnings that a database does not support a feature of an index or a constraint.
_UNSUPPORTED_FEATURE = frozenset(f"models.W{n:03d}" for n in (27, 36, 37, 38, 39, 40, 43, 44))


class Queue(models.Model):
    """A queue's controls, shared by every worker: paused, how many of its jobs may run at once
    and how many may start per second across all workers. A queue without a row runs unpaused
    and unlimited."""

    name = models.CharField(max_length=100, primary_key=True)
    paused = models.BooleanField(default=False, db_default=False)
    max_running = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text=_("Most jobs of this queue running at once; empty for no limit."),
    )
    rate_limit = models.CharField(
        max_length=20,
        null=True,
        blank=True,
        validators=[validate_rate],
        help_text=_(
            "Most jobs of this queue started per second, minute or hour, by all workers "
            'together, as "10/s", "100/m" or "1000/h"; empty for no limit.'
        ),
    )
    #: When the rate limit's bucket is full again (the database's clock; limits.py).
    full_at = models.DateTimeField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(db_default=Now(), auto_now=True)

    objects = QueueQuerySet.as_manager()

    class Meta:
        verbose_name = _("queue")
        verbose_name_plural = _("queues")
        permissions = [("pause_queue", _("Can pause and resume queues"))]

    def __str__(self) -> str:
        return self.name


#: Upper bounds (seconds) of QueueStat.latency_buckets; the last bucket holds the rest.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class QueueStat(models.Model):
    """What one worker did for one queue over one stats interval, written by the worker.

    Reports read these few rows instead of scanning the job table. Claim latency is a histogram
    over LATENCY_BUCKETS so windows and workers add up; a row is written even when idle, so the
    rows also say which workers are alive and which queues they serve."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(db_default=Now())
    seconds = models.FloatField()  # the interval this row covers, ending at `at`
    worker = models.CharField(max_length=200)
    queue = models.CharField(max_length=100)
    claimed = models.IntegerField(default=0)
    succeeded = models.IntegerField(default=0)
    retried = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    latency_buckets = models.JSONField(default=list)
    #: Per task: {task: {"succeeded", "retried", "failed", "durations"}}, the durations a
    #: histogram over DURATION_BUCKETS; None from workers that predate it.
    tasks = models.JSONField(null=True, blank=True)
    # Yielding to the application (runtime/controls.py): the seconds of the interval the queue
    # yielded; the rate it was allowed at the report, in jobs/s (None: not yielding); and the
    # application's open transaction time, smoothed, and its baseline, in ms (None: unmeasured).
    yielded = models.FloatField(default=0.0, db_default=0.0)  # older workers write none
    allowed = models.FloatField(null=True, blank=True)
    open_ms = models.FloatField(null=True, blank=True)
    baseline_ms = models.FloatField(null=True, blank=True)

    class Meta:
        verbose_name = _("queue statistic")
        verbose_name_plural = _("queue statistics")
        indexes = [models.Index(fields=["at"], name="pgjobs_queuestat_at_idx")]

    def __str__(self) -> str:
        return f"{self.queue} by {self.worker} at {self.at}"


class Counts(models.Field):  # type: ignore[type-arg]
    """A bigint[] column (a histogram's counts), which psycopg reads and writes as a list: not
    django.contrib.postgres's ArrayField, which would need that app installed."""

    def db_type(self, connection: Any) -> str:
        return "bigint[]"


class Names(models.Field):  # type: ignore[type-arg]
    """A varchar(100)[] column (queue names), as Counts."""

    def db_type(self, connection: Any) -> str:
        return "varchar(100)[]"


#: Upper bounds (seconds) of a task's run durations (Rollup.durations); the last bucket the rest.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class Rollup(models.Model):
    """The workers' statistics added up by minute and by hour (`step`), per queue and per task
    (`kind`): what the report's charts and windows read, a few hundred rows whatever the number
    of workers. Kept by the database (a trigger on the QueueStat rows, migration 0018), so that
    every report adds to it in the statement that writes its rows."""

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=5)  # "queue" or "task"
    name = models.CharField(max_length=200)
    step = models.IntegerField()  # 60 or 3600
    at = models.DateTimeField()  # the minute's or the hour's start
    #: The earliest instant the rows added up cover (a row covers `seconds` before its `at`).
    since = models.DateTimeField()
    claimed = models.BigIntegerField(default=0)
    succeeded = models.BigIntegerField(default=0)
    retried = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    #: The jobs a queue's yielding workers were allowed (their rate times the seconds it held).
    allowed = models.FloatField(null=True, blank=True)
    #: Claims per LATENCY_BUCKETS (queues), and runs per DURATION_BUCKETS (tasks).
    latency = Counts(default=list)
    durations = Counts(default=list)

    class Meta:
        verbose_name = _("rollup")
        verbose_name_plural = _("rollups")
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "step", "at", "name"], name="pgjobs_rollup_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.name} at {self.at} ({self.step}s)"


class Worker(models.Model):
    """A worker as its last report left it (kept by the same trigger as Rollup): the queues it
    serves, when it reported and over how long, and whether it said it stopped."""

    name = models.CharField(max_length=200, primary_key=True)
    seen_at = models.DateTimeField()
    seconds = models.FloatField()  # the interval its last report covered
    queues = Names(default=list)
    stopped = models.BooleanField(default=False)
    #: Per queue of its last report: its seconds, those it yielded, the rate it was allowed
    #: (jobs/s), the jobs it claimed, and the application's open transaction time and baseline.
    yielding = models.JSONField(null=True, blank=True)

    class Meta:
        verbose_name = _("worker")
        verbose_name_plural = _("workers")
        indexes = [models.Index(fields=["seen_at"], name="pgjobs_worker_seen_idx")]

    def __str__(self) -> str:
        return self.name


class Schedule(models.Model):
    """A periodic schedule's shared state: the last tick handled, so that every worker can enqueue
    due ticks and each tick is enqueued once. Declared in settings or on the task; task, cron and
    timezone are copied here for the admin, and a change restarts the count."""

    name = models.CharField(max_length=200, primary_key=True)
    task = models.CharField(max_length=200)
    cron = models.CharField(max_length=200)
    timezone = models.CharField(max_length=100)
    #: The most recent tick handled: its job enqueued, or skipped by the missed-tick policy.
    last_tick = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = _("periodic schedule")
        verbose_name_plural = _("periodic schedules")

    def __str__(self) -> str:
        return self.name


class Bucket(models.Model):
    """A limited task's rate limit, for one limit key: when its bucket of starts is full again
    (the database's clock). Written by the claims that take its starts; a row whose bucket is
    full says no more than no row, and the pruner deletes those (limits.py)."""

    id = models.BigAutoField(primary_key=True)
    task = models.CharField(max_length=200)
    key = models.CharField(max_length=200)
    full_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "key"], name="pgjobs_bucket_task_key"),
        ]

    def __str__(self) -> str:
        return f"{self.task} [{self.key}]"


class Batch(models.Model):
    """Jobs enqueued together (django_pgjobs.batch), and the callbacks enqueued once when they
    have all finished (on_complete) and when they have all succeeded (on_success). Written
    once with its jobs, then only when the batch completes and when it succeeds: never by a
    member's settle (batches.py)."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    created_at = models.DateTimeField(db_default=Now())
    #: How many jobs were enqueued in the batch's block.
    size = models.IntegerField()
    #: Each callback as the job to insert (task, queue, priority, max_attempts, id, ...), its
    #: payload the one given to batch(); None: no such callback.
    on_complete = models.JSONField(null=True, blank=True)
    on_success = models.JSONField(null=True, blank=True)
    #: When every member had finished (on_complete enqueued then), and how they ended.
    completed_at = models.DateTimeField(null=True, blank=True)
    succeeded = models.IntegerField(null=True, blank=True)
    failed = models.IntegerField(null=True, blank=True)
    cancelled = models.IntegerField(null=True, blank=True)
    #: When every member had succeeded (on_success enqueued then): maybe after replays.
    succeeded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        indexes = [
            # The batches not yet succeeded, which the sweeper looks at (batches.py).
            models.Index(
                fields=["id"], name="pgjobs_batch_open_idx", condition=Q(succeeded_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.short_id}"

    @property
    def short_id(self) -> str:
        return self.id.hex[-12:]


class Dependency(models.Model):
    """One of the jobs or batches a job enqueued with after= waits for (batches.py)."""

    id = models.BigAutoField(primary_key=True)
    # Indexed below (partial where most rows have no value), not by Django's default index.
    job = models.ForeignKey(
        Job, db_constraint=False, db_index=False, on_delete=models.DO_NOTHING,
        related_name="dependencies",
    )  # fmt: skip
    after_job = models.ForeignKey(
        Job, null=True, db_constraint=False, db_index=False, on_delete=models.DO_NOTHING,
        related_name="+",
    )  # fmt: skip
    after_batch = models.ForeignKey(
        Batch, null=True, db_constraint=False, db_index=False, on_delete=models.DO_NOTHING,
        related_name="+",
    )  # fmt: skip
    #: This dependency's failure cancelled the job: its success releases the job again.
    failed = models.BooleanField(default=False, db_default=False)

    class Meta:
        verbose_name = _("dependency")
        verbose_name_plural = _("dependencies")
        indexes = [
            models.Index(fields=["job"], name="pgjobs_dep_job_idx"),
            models.Index(
                fields=["after_job"],
                name="pgjobs_dep_after_job_idx",
                condition=Q(after_job__isnull=False),
            ),
            models.Index(
                fields=["after_batch"],
                name="pgjobs_dep_after_batch_idx",
                condition=Q(after_batch__isnull=False),
            ),
            # The dependencies that cancelled a job: a sweep looks at those (batches.py).
            models.Index(fields=["id"], name="pgjobs_dep_failed_idx", condition=Q(failed=True)),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(after_job__isnull=True) ^ Q(after_batch__isnull=True),
                name="pgjobs_dep_one_target",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_id} after {self.after_job_id or self.after_batch_id}"


class DeadLetter(Job):
    """Failed jobs, kept for inspection and replay: the admin's "Dead letters" entry."""

    class Meta:
        proxy = True
        verbose_name = _("dead letter")
        verbose_name_plural = _("dead letters")
