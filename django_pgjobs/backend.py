"""A backend for Django's Tasks framework: @task functions become jobs that runjobs runs.

``TASKS = {"default": {"BACKEND": "django_pgjobs.backend.PgJobsBackend"}}`` works with
``django.tasks`` (Django 6) and with the ``django-tasks`` backport (Django 5.2). A Task's job has
``task = "django.tasks:<module path>"`` and ``payload = {"args": [...], "kwargs": {...},
"backend": <alias>}``; its return value is kept in ``Job.result``.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import json
import logging
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard
from uuid import UUID

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router
from django.dispatch import Signal
from django.utils import timezone

from django_pgjobs import registry, transports, validation
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data import enqueue
from django_pgjobs.errors import (
    EnqueueError,
    JobCancelled,
    NotJSONSerializable,
    PayloadMismatch,
    PermanentError,
    UnknownTask,
)
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime import execute, handlers
from django_pgjobs.status import Status

if TYPE_CHECKING:
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
else:
    try:  # Django 6 and later
        from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import TaskError
        from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
        from django.tasks.signals import task_enqueued, task_finished, task_started
    except ImportError:  # Django 5.2 with the django-tasks backport (the "tasks" extra)
        from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started

__all__ = ["PgJobsBackend", "WorkerLost"]

logger = logging.getLogger(__name__)

#: The backend's OPTIONS and their defaults.
DEFAULT_OPTIONS: dict[str, Any] = {
    # The framework has no retries: by default an exception makes the result FAILED at once.
    "max_attempts": 1,
}

_STATUSES = {
    Status.READY: TaskResultStatus.READY,
    Status.RUNNING: TaskResultStatus.RUNNING,
    Status.WAITING: TaskResultStatus.READY,  # enqueued with after=: not yet ready to run
    Status.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    Status.FAILED: TaskResultStatus.FAILED,
    # The framework has no "cancelled" (Django 6.0); FAILED means "raised, or could not start".
    Status.CANCELLED: getattr(TaskResultStatus, "CANCELLED", TaskResultStatus.FAILED),
}


#: Stands for the TaskContext when enqueue checks the arguments of a Task that takes one.
_CONTEXT = object()


class WorkerLost(Exception):
    """The error history's WorkerLost entries: the worker running the task died or hung (its
    lease expired, or its supervisor saw its process exit)."""


class PgJobsBackend(BaseTaskBackend):
    """Django Tasks stored as django-pgjobs jobs, in the caller's transaction.

    OPTIONS: ``max_attempts`` (default 1): how many times a Task runs before its result is
    FAILED; exceptions django-pgjobs knows to be permanent fail it at once."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - set(DEFAULT_OPTIONS))
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {unknown}; "
                f"PgJobsBackend reads {sorted(DEFAULT_OPTIONS)}."
            )
        self.max_attempts = self.options.get("max_attempts", DEFAULT_OPTIONS["max_attempts"])
        try:
            validation.check_max_attempts(self.max_attempts)
            for queue in sorted(self.queues):
                validation.check_queue(queue)
        except EnqueueError as error:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]: {error}") from None

    def enqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any, Any]:
        """One job, written by a plain INSERT in the caller's transaction: it commits or rolls
        back with the caller's own writes (there is no waiting for on_commit)."""
        self.validate_task(task)
        _unknown_to_workers(task)
        try:
            # As the worker will call it: a TaskContext first when the Task takes one.
            given = [_CONTEXT, *args] if task.takes_context else list(args)
            check_arguments(task.func, task.module_path, given, kwargs)
        except PayloadMismatch as error:
            raise EnqueueError(f"{error}.") from None
        payload = {
            "args": validation.jsonable(list(args)),
            "kwargs": validation.jsonable(dict(kwargs)),
            "backend": self.alias,
        }
        try:
            job = Job.objects.enqueue(
                registry.Task(task.func, registry.DJANGO_TASK_PREFIX + task.module_path),
                payload,
                queue=task.queue_name,
                priority=task.priority,
                run_at=task.run_after,
                max_attempts=self.max_attempts,
            )
        except EnqueueError as error:
            # A value of a type JSON does not have is also the TypeError the framework raises.
            kind = EnqueueError if _of_json_types(payload) else NotJSONSerializable
            raise kind(f"{task.module_path}: {error}") from None
        result = to_task_result(job, task)
        # Robust: the row is written; a receiver's error raised here would get it enqueued twice.
        send(task_enqueued, result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        """The result of a Task enqueued through this backend alias, read from the database
        jobs are written to (a replica may not have it yet, even right after the enqueue)."""
        try:
            pk = UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        jobs = Job.objects.db_manager(router.db_for_write(Job))
        job = jobs.filter(
            pk=pk, task__startswith=registry.DJANGO_TASK_PREFIX, payload__backend=self.alias
        ).first()
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            return to_task_result(job)
        except (UnknownTask, PayloadMismatch) as error:
            raise TaskResultDoesNotExist(f"{result_id}: {error}") from None

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        if not apps.is_installed("django_pgjobs"):
            return [
                checks.Error(
                    f"TASKS[{self.alias!r}] uses PgJobsBackend, but django_pgjobs is not "
                    "installed.",
                    hint="Add 'django_pgjobs' to INSTALLED_APPS and run migrate.",
                    id="pgjobs.E002",
                )
            ]
        on_nats = sorted(set(self.queues) & set(transports.nats_queues()))
        if not on_nats:
            return []
        return [
            checks.Warning(
                f"TASKS[{self.alias!r}] enqueues into {', '.join(map(repr, on_nats))}, carried by "
                "NATS JetStream: a Task run there keeps no result (its row leaves the database "
                "when relayed), so get_result() raises TaskResultDoesNotExist for it once "
                "relayed, however it ended, unless it failed for good (a dead letter).",
                hint="Keep Tasks whose results you read on PostgreSQL queues; see "
                "docs/explanation/graduating.md.",
                id="pgjobs.W042",
            )
        ]


def run(job: Job) -> Handled:
    """Run a job of Django's Tasks framework: its Task with the payload's args and kwargs (a
    TaskContext first when the Task takes one), sending the framework's task signals. The
    return value is kept as the job's result; one JSON cannot hold fails the job for good."""
    try:
        task = get_django_task(job.task)
        result = running(job, task)
        args = (
            [TaskContext(task_result=result), *result.args] if task.takes_context else result.args
        )
        check_arguments(task.func, task.module_path, args, result.kwargs)
    except UnknownTask as error:
        return execute.refused(error, explained=registry.unknown_task_help(job.task))
    except PayloadMismatch as error:
        return execute.refused(error)
    except Exception as error:  # e.g. a broken TASKS setting: retried, as it may be fixed
        return execute.raised(job, error, None, (), time.perf_counter())
    send(task_started, result)
    if job.cancel_requested:
        # Cancelled or timed out while task_started's receivers ran: the function must not begin.
        cancelled = JobCancelled("cancelled before its function started")
        handled = execute.refused(cancelled)
        if handlers.keep_outcome(job, handled):
            finished(result, error=cancelled)
        return handled
    with execute.running(job):
        began = time.perf_counter()
        unstorable: Exception | None = None
        try:
            if inspect.iscoroutinefunction(task.func):  # as Task.call, without its hang
                value = execute.awaited(job, task.func, *args, **result.kwargs)
            else:
                value = task.func(*args, **result.kwargs)
            try:
                kept = result_json(value)
            except EnqueueError as error:
                unstorable = _unstorable(f"{task.module_path}: {error}", value)
                raise unstorable from None
        except BaseException as error:
            # A return value that JSON cannot hold fails for good: it would come back the same.
            permanent = (TypeError,) if error is unstorable else ()
            handled = execute.raised(job, error, None, permanent, began)
            # keep_outcome: an attempt timed out meanwhile is its time limit's to tell (timed_out)
            if handlers.keep_outcome(job, handled) and _the_last(job, handled):
                finished(result, error=error)
            return handled
    handled = Handled(Verdict.SUCCEEDED, duration=time.perf_counter() - began, result_json=kept)
    if handlers.keep_outcome(job, handled):
        finished(result, json.loads(kept))
    return handled


def timed_out(job: Job, error: BaseException, handled: Handled) -> None:
    """A Task's attempt passed its time limit: when it was the last one, task_finished says
    FAILED with the JobTimeout now, not when (or if) the function returns. The receivers run on
    a thread of their own: a slow one must not hold up the worker's main thread."""
    if not _the_last(job, handled):
        return

    def tell() -> None:
        try:
            result = running(job, get_django_task(job.task))
            try:
                raise error  # as in run: receivers that log with exc_info see the JobTimeout
            except BaseException:
                finished(result, error=error)
        except Exception:  # e.g. TASKS changed under the worker: the job's row says it all
            logger.exception("task_finished could not be sent for job %s", job.pk)
        finally:
            connections.close_all()  # this thread's, if a receiver used the database

    try:
        handlers.run_hook_aside(tell, "task_finished receivers")
    except RuntimeError:  # no thread to be had: the worker goes on, the row says it all
        logger.exception("task_finished could not be sent for job %s", job.pk)


def _the_last(job: Job, handled: Handled) -> bool:
    """Whether this failed attempt ends the job (no retry follows)."""
    return handled.verdict is Verdict.ERROR and (
        handled.permanent or job.attempts >= job.max_attempts
    )


def get_django_task(name: str) -> Task[Any, Any]:
    """The Django Task object a job's `task` names; UnknownTask unless it is one we run.

    A job row must not make a worker call an arbitrary importable function: only a module of
    an installed app (or one imported already) is imported, and only a Task whose backend is
    django-pgjobs' is accepted.
    """
    path = name.removeprefix(registry.DJANGO_TASK_PREFIX)
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not (module_name in sys.modules or _of_an_installed_app(module_name)):
        raise UnknownTask(
            f"{name!r} does not name a Django Task in an installed app's module; "
            "only Tasks defined in installed apps (or in modules already imported) are run."
        )
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except Exception as error:  # ImportError, or whatever the module raised while importing
        raise UnknownTask(
            f"{name!r}: its module cannot be imported ({type(error).__name__}: {error})."
        ) from None
    if not is_pgjobs_task(found):
        raise UnknownTask(
            f"{name!r} is not a Django Task (a function decorated with @task from django.tasks "
            "or django_tasks) whose backend is django_pgjobs.backend.PgJobsBackend."
        )
    return found


def _of_an_installed_app(module_name: str) -> bool:
    return any(
        module_name == app.name or module_name.startswith(f"{app.name}.")
        for app in apps.get_app_configs()
    )


def _unknown_to_workers(task: Task[Any, Any]) -> None:
    """Say once per Task defined outside the installed apps that a worker imports its module
    only if something else did."""
    module = task.func.__module__
    if not _of_an_installed_app(module):
        enqueue.warn_unknown_to_workers(
            task.module_path,
            "the Task %s is defined in %s, which is not part of an installed app: a worker "
            "imports a Task's module only from an installed app, so unless its start-up imports "
            "%s anyway, its jobs become dead letters (UnknownTask). Define Tasks in an "
            "installed app.",
            module,
        )


def is_pgjobs_task(value: object) -> TypeGuard[Task[Any, Any]]:
    """True for a Django Task whose backend alias is configured with PgJobsBackend."""
    return isinstance(value, Task) and _is_our_alias(value.backend)


def _is_our_alias(alias: object) -> bool:
    try:
        return isinstance(alias, str) and isinstance(task_backends[alias], PgJobsBackend)
    except ImproperlyConfigured:  # no such alias, or its backend cannot be loaded
        return False


def to_task_result(job: Job, task: Task[Any, Any] | None = None) -> TaskResult[Any, Any]:
    """The job as the framework's TaskResult, for `task` (by default the Task the job names, as
    enqueued). PayloadMismatch for a job not a Django Task's, UnknownTask for a Task not ours."""
    args, kwargs, alias = _arguments(job)
    if task is None:
        task = _as_enqueued(get_django_task(job.task), job, alias)
    status = Status(job.status)
    result: TaskResult[Any, Any] = TaskResult(
        task=task,
        id=str(job.pk),
        status=_STATUSES[status],
        enqueued_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        last_attempted_at=job.started_at,
        args=args,
        kwargs=kwargs,
        backend=alias,
        errors=[
            _task_error(entry)
            for entry in job.errors
            if isinstance(entry, Mapping) and "replayed_at" not in entry  # a replay, not an error
        ],
        worker_ids=_worker_ids(job),
    )
    if status == Status.SUCCEEDED:
        object.__setattr__(result, "_return_value", job.result)
    return result


def running(job: Job, task: Task[Any, Any]) -> TaskResult[Any, Any]:
    """The TaskResult a claimed job's Task sees (in its TaskContext and in task_started)."""
    alias = _arguments(job)[2]
    return to_task_result(job, _as_enqueued(task, job, alias))


def finished(
    result: TaskResult[Any, Any], value: Any = None, error: BaseException | None = None
) -> None:
    """Mark `result` SUCCESSFUL (with `value`) or FAILED (with `error`) and send task_finished."""
    object.__setattr__(result, "finished_at", timezone.now())
    if error is None:
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
    else:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        kind = type(error)
        result.errors.append(
            TaskError(
                exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
                traceback="".join(traceback.format_exception(error)),
            )
        )
    send(task_finished, result)


def send(signal: Signal, result: TaskResult[Any, Any]) -> None:
    """Send a task signal: a receiver that raises is logged, never propagated."""
    sender = type(task_backends[result.backend])
    responses: Sequence[tuple[object, object]]
    try:
        responses = signal.send_robust(sender, task_result=result)
    except BaseException as error:  # SystemExit: send_robust lets it through; the receiver's
        # bug must not turn the task's outcome into a failure
        responses = [(None, error)]
    for receiver, response in responses:
        if isinstance(response, BaseException):
            with contextlib.suppress(Exception):  # the application's logging may raise too
                logger.error("a receiver of a task signal raised: %r", receiver, exc_info=response)


def result_json(value: Any) -> str:
    """A Task's return value as JSON text for Job.result; EnqueueError (a ValueError) saying
    what does not survive JSON (tuples become lists and bytes text, as the framework does)."""
    return validation.json_text(
        validation.jsonable(value),
        "the return value",
        get_settings().MAX_PAYLOAD_BYTES,
        "Store large results elsewhere and return their id.",
    )


def _unstorable(message: str, value: Any) -> Exception:
    """The error of a Task whose return `value` does not survive JSON: a TypeError for a type
    JSON does not have, as the framework's own backends record it, else a PermanentError."""
    return (
        PermanentError(message)
        if _of_json_types(validation.jsonable(value))
        else TypeError(message)
    )


def _of_json_types(value: Any) -> bool:
    """Whether `value` is made of JSON's types (and bytes) only: what does not survive JSON
    then is a value (NaN, a NUL, its size), for which the framework raises no TypeError."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and _of_json_types(item) for key, item in value.items())
    if isinstance(value, list):
        return all(_of_json_types(item) for item in value)
    return value is None or isinstance(value, str | int | float | bool | bytes)


def _arguments(job: Job) -> tuple[list[Any], dict[str, Any], str]:
    payload = job.payload
    if isinstance(payload, Mapping):
        args, kwargs, alias = payload.get("args"), payload.get("kwargs"), payload.get("backend")
        if isinstance(args, list) and isinstance(kwargs, dict) and _is_our_alias(alias):
            return args, kwargs, str(alias)
    raise PayloadMismatch(
        "a Django Task's job needs the payload {'args': [...], 'kwargs': {...}, 'backend': "
        f"<a TASKS alias that uses PgJobsBackend>}}, got {_shape(payload)}"
    )


def _as_enqueued(task: Task[Any, Any], job: Job, alias: str) -> Task[Any, Any]:
    """`task` with the options the job was enqueued with, as the framework's results carry."""
    # run_at equals created_at unless the job was deferred (both are the INSERT's clock).
    run_after = None if job.run_at == job.created_at else job.run_at
    try:
        return task.using(
            priority=job.priority, queue_name=job.queue, run_after=run_after, backend=alias
        )
    except InvalidTask:  # e.g. replayed into a queue the backend's QUEUES do not list
        return task


def _task_error(entry: Mapping[str, Any]) -> TaskError:
    kind = str(entry.get("type") or "Exception")
    message = str(entry.get("message") or "")
    return TaskError(
        exception_class_path=_class_path(kind),
        traceback=str(entry.get("traceback") or (f"{kind}: {message}" if message else kind)),
    )


def _class_path(kind: str) -> str:
    """An importable path, as TaskError.exception_class needs: the history names builtins
    without their module, and the reaper's entries "WorkerLost"."""
    if "." in kind:
        return kind
    if isinstance(getattr(builtins, kind, None), type):
        return f"builtins.{kind}"
    return f"{__name__}.WorkerLost" if kind == "WorkerLost" else "builtins.Exception"


def _worker_ids(job: Job) -> list[str]:
    """One worker per attempt, from the error history and the job's last worker; attempts
    older than the kept history are "unknown"."""
    by_attempt = {
        entry.get("attempt"): str(entry.get("worker") or "unknown")
        for entry in job.errors
        if isinstance(entry, Mapping)
    }
    if job.attempts and job.worker:
        by_attempt.setdefault(job.attempts, job.worker)
    return [by_attempt.get(attempt, "unknown") for attempt in range(1, job.attempts + 1)]


def _shape(payload: Any) -> str:
    if isinstance(payload, Mapping):
        return "{" + ", ".join(f"{key!r}: {type(v).__name__}" for key, v in payload.items()) + "}"
    return type(payload).__name__


registry.add_runner(registry.DJANGO_TASK_PREFIX, run, timed_out)
