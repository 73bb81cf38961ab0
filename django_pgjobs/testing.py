"""Helpers for your own tests: run due jobs in the test, and assert what was enqueued.

They work in Django's ``TestCase`` (jobs enqueued in the test's transaction are visible and run
inside it), in ``TransactionTestCase`` and in pytest-django tests, as plain functions.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import connections, router, transaction
from django.db.models.functions import Now

from django_pgjobs import batches, registry, signals, validation
from django_pgjobs.errors import UnknownTask
from django_pgjobs.limits import TaskLimits
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime import execute
from django_pgjobs.status import Status

__all__ = ["JobError", "JobsRun", "assert_enqueued", "assert_not_enqueued", "enqueued", "run_jobs"]

#: How many jobs one run_jobs() call runs at most, unless told otherwise.
MAX_JOBS = 1000
#: run_jobs runs limited tasks' jobs as if they had no limits: a test runs them one by one.
NO_LIMITS = TaskLimits()


class JobError(AssertionError):
    """A job run by ``run_jobs(raise_errors=True)`` raised; the message has its traceback."""


@dataclass
class JobsRun:
    """What one ``run_jobs()`` call ran: the jobs, in the order they ran, as they are now."""

    jobs: list[Job] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def counts(self) -> Counter[str]:
        """Jobs by their status after the run: succeeded, ready (to be retried) or failed."""
        return Counter(job.status for job in self.jobs)

    @property
    def succeeded(self) -> list[Job]:
        return [job for job in self.jobs if job.status == Status.SUCCEEDED]

    @property
    def failed(self) -> list[Job]:
        return [job for job in self.jobs if job.status == Status.FAILED]

    @property
    def retrying(self) -> list[Job]:
        return [job for job in self.jobs if job.status == Status.READY]

    def __repr__(self) -> str:
        runs = ", ".join(f"{job.task} → {job.status}" for job in self.jobs)
        return f"JobsRun({len(self.jobs)} jobs: {runs})"


def run_jobs(
    *,
    queues: Iterable[str] | None = None,
    tasks: Iterable[Any] | None = None,
    advance: timedelta | None = None,
    raise_errors: bool = False,
    max_jobs: int = MAX_JOBS,
    using: str | None = None,
) -> JobsRun:
    """Claim and run due jobs on this thread and connection, until none are due.

    Jobs go through the worker's own steps, so retries, dead letters, results and Django Tasks'
    signals behave as under ``runjobs``. Jobs that the jobs enqueue run too, when due.

    - `queues`, `tasks`: only these queues, or only jobs of these tasks (``@task`` functions,
      Django Tasks or task names); other due jobs stay ready.
    - `advance`: ready jobs scheduled within `advance` from now (delays, retries' backoffs) are
      made due before each round, since the database's clock decides, not Python's.
    - `raise_errors`: raise JobError for the first job that raises, after recording it.
    - `max_jobs`: stop with JobError after running this many jobs (a job that enqueues itself
      would otherwise never let the loop end).

    Limited tasks' jobs run too, without their limits (docs/howto/flow-control.md).

    Inside a transaction (a ``TestCase``), each job runs in a savepoint that is rolled back when
    it raises, so that a database error in a handler cannot break the test's transaction.
    """
    db = using or router.db_for_write(Job)
    jobs = Job.objects.db_manager(db)
    names = None if tasks is None else {_task_name(task) for task in tasks}
    selected = jobs.ready()
    if queues is not None:
        selected = selected.filter(queue__in=list(queues))
    if names is not None:
        selected = selected.filter(task__in=names)
    worker = f"run_jobs:{os.getpid()}"
    run = JobsRun()
    # A test's transaction never commits: batches and dependencies are followed up in it, and
    # what the test's own enqueues and transitions left to follow up after a commit is swept.
    in_test = connections[db].in_atomic_block
    with batches.at_once() if in_test else contextlib.nullcontext():
        while True:
            if in_test:
                batches.Sweep()(db)
            if advance is not None:
                selected.filter(run_at__gt=Now(), run_at__lte=Now() + advance).run_now()
            jobs.promote()  # limited tasks' scheduled jobs come due: their claim reads only these
            due_queues = selected.filter(run_at__lte=Now()).values_list("queue", flat=True)
            queue_names = sorted(set(due_queues))
            if not queue_names:
                return run
            # Claim every due job of those queues, so others cannot crowd out the selected ones.
            due = jobs.due().filter(queue__in=queue_names).count()
            most = max(due, 1)
            claimed = jobs.claim(queue_names, worker=worker, limit=most)
            for queue in queue_names:  # limited tasks' jobs too, without their limits
                claimed += jobs.claim_keyed(queue, NO_LIMITS, worker=worker, limit=most).claimed
            if not claimed:
                return run  # due jobs another session holds locked: not this loop's to wait for
            mine = [job for job in claimed if names is None or job.task in names]
            jobs.release([job for job in claimed if job not in mine])
            for n, job in enumerate(mine):
                if len(run) >= max_jobs:
                    jobs.release(mine[n:])
                    raise JobError(
                        f"run_jobs ran {max_jobs} jobs and more are due: does a job enqueue "
                        "itself, or ask to Retry at once? Pass max_jobs= to allow more."
                    )
                outcome = _run_one(job, db)
                job.refresh_from_db()
                run.jobs.append(job)
                if raise_errors and outcome.verdict is Verdict.ERROR:
                    assert outcome.failure is not None
                    jobs.release(mine[n + 1 :])
                    raise JobError(
                        f"job {job.pk} ({job.task}) raised {outcome.failure.summary}\n\n"
                        f"{outcome.failure.traceback}"
                    )


def _run_one(job: Job, db: str) -> Handled:
    """Run and record one claimed job, sending the lifecycle signals the worker sends."""
    signals.send(signals.job_started, Job, job=job)
    if connections[db].in_atomic_block:
        try:
            with transaction.atomic(using=db):  # a savepoint
                outcome = execute.run(job)
                if outcome.verdict is not Verdict.SUCCEEDED:
                    raise _Undo(outcome)
        except _Undo as undo:
            outcome = undo.outcome
    else:
        outcome = execute.run(job)
    recorded = execute.settle(job, outcome)
    signals.announce(
        job, recorded, duration=outcome.duration, error=outcome.failure, delay=outcome.delay
    )
    return outcome


class _Undo(Exception):
    """Rolls back the savepoint of a job that raised, keeping its outcome."""

    def __init__(self, outcome: Handled) -> None:
        self.outcome = outcome


def enqueued(
    task: Any = None, /, *args: Any, using: str | None = None, **payload: Any
) -> list[Job]:
    """Ready jobs (due or scheduled), oldest first: of `task` (a ``@task`` function, a Django
    Task or a task name) when given, whose payload has these values (for a Django Task, `args`
    must equal its args, and the keyword values are looked for in its kwargs)."""
    db = using or router.db_for_write(Job)
    ready = Job.objects.db_manager(db).ready().order_by("created_at", "id")
    if task is not None:
        ready = ready.filter(task=_task_name(task))
    return [job for job in ready if _matches(job, args, payload)]


def assert_enqueued(task: Any, /, *args: Any, using: str | None = None, **payload: Any) -> Job:
    """Assert that a ready job of `task` has this payload (the keys given; others may differ),
    and return the newest such job. The failure message lists what is enqueued."""
    found = enqueued(task, *args, using=using, **payload)
    if not found:
        raise AssertionError(
            f"No ready job of {_task_name(task)} with {_describe(args, payload)}.\n"
            f"{_listing(using)}"
        )
    return found[-1]


def assert_not_enqueued(task: Any, /, *args: Any, using: str | None = None, **payload: Any) -> None:
    """Assert that no ready job of `task` has this payload (with no payload: no job of `task`)."""
    found = enqueued(task, *args, using=using, **payload)
    if found:
        raise AssertionError(
            f"Expected no ready job of {_task_name(task)} with {_describe(args, payload)}, "
            f"found {len(found)}.\n{_listing(using)}"
        )


def _task_name(task: Any) -> str:
    if isinstance(task, str):
        return task
    if isinstance(task, registry.Task):
        return task.name
    module_path = getattr(task, "module_path", None)
    if isinstance(module_path, str) and hasattr(task, "get_backend"):  # a Django Task
        return registry.DJANGO_TASK_PREFIX + module_path
    raise UnknownTask(f"task must be a @task function, a Django Task or a task name, got {task!r}.")


def _matches(job: Job, args: tuple[Any, ...], payload: Mapping[str, Any]) -> bool:
    values = job.payload if isinstance(job.payload, dict) else {}
    if registry.is_django_task(job.task):
        if args and values.get("args") != validation.jsonable(args):
            return False
        values = values.get("kwargs") or {}
    elif args:
        return False
    return all(
        key in values and values[key] == validation.jsonable(value)
        for key, value in payload.items()
    )


def _describe(args: tuple[Any, ...], payload: Mapping[str, Any]) -> str:
    parts = [repr(list(args))] if args else []
    parts += [f"{key}={value!r}" for key, value in payload.items()]
    return ", ".join(parts) if parts else "any payload"


def _listing(using: str | None, limit: int = 20) -> str:
    ready = list(enqueued(using=using))
    if not ready:
        return "No job is ready."
    lines = [
        f"  {job.task} {job.payload} queue={job.queue} run_at={job.run_at:%Y-%m-%d %H:%M:%S}"
        for job in ready[:limit]
    ]
    more = f"\n  ... and {len(ready) - limit} more" if len(ready) > limit else ""
    return f"Ready jobs ({len(ready)}):\n" + "\n".join(lines) + more
