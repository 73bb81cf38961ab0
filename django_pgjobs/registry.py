"""The task registry: @task, Task objects and lookup by name. Only registered tasks ever run."""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Never, overload

from django.apps import apps
from django.conf import settings

from django_pgjobs import limits, validation
from django_pgjobs.cron import check_cron
from django_pgjobs.errors import CelerySpelling, EnqueueError, UnknownTask, celery_spelling
from django_pgjobs.validation import MAX_SECONDS, check_queue

if TYPE_CHECKING:
    from django_pgjobs.models import Job
    from django_pgjobs.outcomes import Handled

Backoff = Callable[[int], float]
"""Seconds to wait before the next try, given the number of attempts made so far."""


@dataclass(frozen=True)
class Task:
    """A registered handler and its defaults. Call it to run the function directly."""

    func: Callable[..., Any]
    name: str
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    backoff: Backoff | None = None
    lease: float | None = None
    #: Seconds one attempt may run before it fails with JobTimeout; None: PGJOBS["TIMEOUT"].
    timeout: float | None = None
    permanent_errors: tuple[type[BaseException], ...] = ()
    #: Payload keys shown as "[redacted]" in the admin and in logs.
    redact: frozenset[str] = field(default_factory=frozenset)
    #: A cron expression: run periodically, in TIME_ZONE, with an empty payload (periodic.py).
    cron: str | None = None
    #: Flow control, held by all workers together (limits.py): starts per second, jobs
    #: running at once, and what they are held per (a payload argument's name, or a function
    #: of the payload returning a string; its values also take turns).
    rate_limit: limits.Rate | None = None
    concurrency_limit: int | None = None
    limit_by: limits.LimitBy | None = None
    #: Registered after start-up (see _starting_up), from a module a worker may never import.
    late: bool = field(default=False, compare=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    @property
    def limited(self) -> bool:
        """Whether its jobs are claimed under flow control (each with a limit key)."""
        return not (self.rate_limit is None and self.concurrency_limit is None
                    and self.limit_by is None)  # fmt: skip

    @cached_property  # asked at every run of the task's jobs; func never changes
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    def enqueue(self, **kwargs: Any) -> Job:
        """Enqueue one job with these keyword arguments as its payload."""
        return TaskCall(self).enqueue(**kwargs)

    def using(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        after: Any = None,
    ) -> TaskCall:
        """Options for the next enqueue: ``my_task.using(delay=60).enqueue(user_id=1)``;
        ``after=[job, batch]``: it waits until those have succeeded (batches.py)."""
        return TaskCall(
            self,
            {
                "queue": queue,
                "priority": priority,
                "run_at": run_at,
                "delay": delay,
                "max_attempts": max_attempts,
                "unique_key": unique_key,
                "after": after,
            },
        )

    def redacted(self, payload: Any) -> Any:
        """The payload as it may be shown to people: the task's `redact` keys masked."""
        if not self.redact or not isinstance(payload, Mapping):
            return payload
        return {k: "[redacted]" if k in self.redact else v for k, v in payload.items()}

    if not TYPE_CHECKING:  # a type checker still refuses every attribute a Task does not have

        def __getattr__(self, name: str) -> Any:
            # Called only for attributes the Task does not have: Celery's say what to write.
            if name in _CELERY_ATTRIBUTES:
                raise CelerySpelling(
                    f"Task {self.name!r} has no attribute {name!r}: {_CELERY_ATTRIBUTES[name]}."
                )
            raise AttributeError(f"'Task' object has no attribute {name!r}")


@dataclass(frozen=True)
class TaskCall:
    task: Task
    options: dict[str, Any] = field(default_factory=dict)

    def enqueue(self, **kwargs: Any) -> Job:
        # Looked up by label: this module loads with the package, before the models can.
        jobs = apps.get_model("pgjobs", "Job").objects
        job: Job = jobs.enqueue(self.task, kwargs, **self.options)
        return job


_NO_SIGNATURES = (
    "there are no signatures; for a chain, enqueue each step with "
    "task.using(after=[previous_job]).enqueue(**payload), which runs once that job succeeded "
    "(or enqueue the next job from the handler); for a group or a chord, enqueue the jobs "
    "inside with django_pgjobs.batch(on_success=..., on_complete=...), whose callbacks are "
    "enqueued once when they have all succeeded, or all finished (docs/howto/batches.md)"
)

#: Celery's attributes of a task, and what to write instead (docs/howto/from-celery.md).
_CELERY_ATTRIBUTES = {
    "delay": (
        "Celery's delay() is task.enqueue(**payload) here, with keyword arguments only "
        "(delay= is an option: task.using(delay=...).enqueue(**payload))"
    ),
    "apply_async": (
        "Celery's apply_async() is task.enqueue(**payload) here, with keyword arguments only; "
        "pass options with task.using(delay=..., run_at=..., queue=..., priority=...)"
        ".enqueue(**payload) or Job.objects.enqueue(task, payload, delay=...)"
    ),
    "s": _NO_SIGNATURES,
    "si": _NO_SIGNATURES,
    "signature": _NO_SIGNATURES,
    **{
        name: f"there is no {name}(): Job.objects.bulk_enqueue(task, payloads) enqueues a job "
        "per payload"
        for name in ("map", "starmap", "chunks")
    },
}

_TIMEOUT = (
    "pass timeout=<seconds> (an attempt past it is recorded as failed, JobTimeout, and "
    "cancel_requested() turns True; nothing is killed)"
)

#: Celery's options of @task, and what to write instead (docs/howto/from-celery.md).
_CELERY_OPTIONS = {
    "bind": (
        "a handler takes no self here; call django_pgjobs.current_job() in the handler for the "
        "running job (its pk, attempts, worker)"
    ),
    "max_retries": (
        "pass max_attempts=<max_retries + 1> (it counts attempts, the first run included: "
        "max_retries=3 is max_attempts=4)"
    ),
    "acks_late": (
        "drop it, as django-pgjobs always acknowledges late (a job whose worker dies runs "
        "again after its lease)"
    ),
    "soft_time_limit": _TIMEOUT,
    "time_limit": _TIMEOUT,
}


_registry: dict[str, Task] = {}


@overload
def task(func: Callable[..., Any], /) -> Task: ...
@overload
def task(
    *,
    name: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    backoff: Backoff | None = None,
    lease: float | None = None,
    timeout: float | None = None,
    permanent_errors: Collection[type[BaseException]] = (),
    redact: Collection[str] = (),
    cron: str | None = None,
    rate_limit: str | None = None,
    concurrency_limit: int | None = None,
    limit_by: limits.LimitBy | None = None,
) -> Callable[[Callable[..., Any]], Task]: ...
def task(
    func: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    backoff: Backoff | None = None,
    lease: float | None = None,
    timeout: float | None = None,
    permanent_errors: Collection[type[BaseException]] = (),
    redact: Collection[str] = (),
    cron: str | None = None,
    rate_limit: str | None = None,
    concurrency_limit: int | None = None,
    limit_by: limits.LimitBy | None = None,
    **celery: Never,
) -> Task | Callable[[Callable[..., Any]], Task]:
    """Register a function as a task, by default under its dotted path ``module.function``.

    Use bare (``@task``) or with options (``@task(queue="emails", max_attempts=10)``). With
    ``cron="*/5 * * * *"`` the workers also enqueue it on that schedule, with an empty payload.
    """
    if celery:  # Celery's options (bind=True, max_retries=...): say what to write instead
        spellings = dict(_CELERY_OPTIONS)
        given: Mapping[str, object] = celery
        retries = given.get("max_retries")
        if isinstance(retries, int) and not isinstance(retries, bool):
            spellings["max_retries"] = (
                f"pass max_attempts={retries + 1} (it counts attempts, the first run included)"
            )
        raise celery_spelling("@task", celery, spellings)

    def register(func: Callable[..., Any]) -> Task:
        if queue is not None:
            check_queue(queue)
        for option, seconds in (("lease", lease), ("timeout", timeout)):
            if seconds is not None and not (
                isinstance(seconds, int | float)
                and not isinstance(seconds, bool)
                and 0 < seconds < MAX_SECONDS
            ):
                raise ValueError(
                    f"@task({option}=...) must be a positive number of seconds below "
                    f"{MAX_SECONDS:g}, got {seconds!r}."
                )
        if max_attempts is not None:
            try:
                validation.check_max_attempts(max_attempts)
            except EnqueueError as error:
                raise ValueError(f"@task(max_attempts=...): {error}") from None
        named = name or f"{func.__module__}.{func.__qualname__}"
        try:
            validation.check_task_name(named)
        except EnqueueError as error:
            raise ValueError(f"@task: {error}") from None
        if cron is not None:
            check_cron(cron, "@task(cron=...)")
        rate = (
            None if rate_limit is None else limits.parse_rate(rate_limit, "@task(rate_limit=...)")
        )
        registered = Task(
            func=func,
            name=named,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            backoff=backoff,
            lease=lease,
            timeout=timeout,
            permanent_errors=tuple(permanent_errors),
            redact=frozenset(redact),
            cron=cron,
            rate_limit=rate,
            concurrency_limit=(
                None if concurrency_limit is None else limits.check_concurrency(concurrency_limit)
            ),
            limit_by=None if limit_by is None else limits.check_limit_by(limit_by, func),
        )
        existing = _registry.get(registered.name)
        if (existing is None or existing.late) and not _starting_up():
            registered = replace(registered, late=True)
        if (
            existing is not None
            and existing.func is not func
            and not _same_function(existing, func)
        ):
            raise ValueError(
                f"Two tasks are registered as {registered.name!r}: "
                f"{existing.func!r} and {func!r}. Give one a different name=."
            )
        _registry[registered.name] = registered
        return registered

    return register(func) if func is not None else register


def _starting_up() -> bool:
    """Whether what registers a task now is imported by every process's start-up: django.setup()
    or the URLconf's first import (runjobs' system checks load it too)."""
    if not apps.ready:
        return True
    urlconf = sys.modules.get(getattr(settings, "ROOT_URLCONF", None) or "")
    return urlconf is not None and not hasattr(urlconf, "urlpatterns")  # still importing


def _same_function(existing: Task, func: Callable[..., Any]) -> bool:
    # A module imported twice (e.g. reloaded by the autoreloader) re-registers the same function.
    old = existing.func
    return (old.__module__, old.__qualname__) == (func.__module__, func.__qualname__)


def get_task(name: str) -> Task:
    """The registered task called `name`; UnknownTask if there is none. Never imports anything."""
    try:
        return _registry[name]
    except KeyError:
        if is_django_task(name):
            raise UnknownTask(
                f"{name!r} is a Task of Django's Tasks framework, but no TASKS backend in this "
                "process uses django_pgjobs.backend.PgJobsBackend (on Django 5.2, install "
                "django-pgjobs[tasks])."
            ) from None
        raise UnknownTask(
            f"No task is registered as {name!r}. Decorate the function with @task in an "
            f"installed app's tasks module (registered tasks: {_known()})."
        ) from None


def unknown_task_help(name: str) -> str:
    """What a worker saves, in place of a traceback, for a job whose task `name` it cannot run:
    why, the registered tasks whose names look close, and what to do."""
    if is_django_task(name):
        why = (
            "a worker runs only the Tasks of installed apps whose backend is "
            "django_pgjobs.backend.PgJobsBackend in its TASKS setting"
        )
        seen = ""
    else:
        why = (
            "a worker runs only the tasks its own code registers with @task, and never imports "
            "one by the name in a job"
        )
        close = _close_names(name)
        seen = (
            f"Registered tasks with a close name: {', '.join(close)}. A function that was "
            "renamed or moved keeps its jobs' name with @task(name=...).\n"
            if close
            else f"No registered task has a close name (registered tasks: {_known()}).\n"
        )
    return (
        f"This worker cannot run {name!r}: {why}.\n{seen}"
        "To run the job: deploy the code that defines it to every worker, then replay the job "
        "(the admin's Dead letters, or Job.objects.filter(pk=...).replay()).\n"
        "If nothing should run it any more: delete the job.\n"
    )


def _close_names(name: str) -> list[str]:
    """Up to 3 registered names like `name`: the same function in another module first (moved),
    then names a few characters apart (a typo, a rename)."""
    function = name.rpartition(".")[2]
    close = [other for other in sorted(_registry) if other.rpartition(".")[2] == function]
    rest = [other for other in _registry if other not in close]
    return (close + difflib.get_close_matches(name, rest, n=3, cutoff=0.8))[:3]


def resolve(task_or_name: Task | str) -> Task:
    if isinstance(task_or_name, Task):
        if runner_for(task_or_name.name):
            return task_or_name  # an integration's (e.g. backend.py); found again when it runs
        return get_task(task_or_name.name)
    if isinstance(task_or_name, str):
        return get_task(task_or_name)
    raise EnqueueError(
        "task must be a registered task name or a @task function, "
        f"got {type(task_or_name).__name__}."
    )


def all_tasks() -> dict[str, Task]:
    return dict(_registry)


def _known() -> str:
    names = sorted(_registry)
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return shown or "none"


#: The task names of jobs enqueued through Django's Tasks framework (backend.PgJobsBackend):
#: this prefix and the Task's module path, e.g. ``django.tasks:shop.tasks.send_receipt``.
DJANGO_TASK_PREFIX = "django.tasks:"


def is_django_task(name: str) -> bool:
    """Whether a job's `task` names a Task of Django's Tasks framework."""
    return name.startswith(DJANGO_TASK_PREFIX)


# ---- runners ---------------------------------------------------------------------------------

#: Runs a job of an integration's task (e.g. backend.py's), and says how its handler ended.
Runner = Callable[["Job"], "Handled"]
#: Told, on the worker's main thread, that an attempt of an integration's job timed out (its
#: handler may still run): the job, the JobTimeout and how the attempt is recorded.
TimedOut = Callable[["Job", BaseException, "Handled"], None]

_runners: dict[str, Runner] = {}
_timed_out: dict[str, TimedOut] = {}


def add_runner(prefix: str, runner: Runner, timed_out: TimedOut | None = None) -> None:
    """Let `runner` run the jobs whose task name starts with `prefix` (an integration's, e.g.
    backend.py), and `timed_out` hear of their attempts that pass their time limit."""
    _runners[prefix] = runner
    if timed_out is not None:
        _timed_out[prefix] = timed_out


def timed_out_hook(name: str) -> TimedOut | None:
    """The time-out hook of an integration's job (see add_runner), else None."""
    for prefix, hook in _timed_out.items():
        if name.startswith(prefix):
            return hook
    return None


def runner_for(name: str) -> Runner | None:
    """The runner of an integration's job (see add_runner), else None."""
    for prefix, runner in _runners.items():
        if name.startswith(prefix):
            return runner
    return None
