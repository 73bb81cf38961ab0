"""What a worker tells of its work: its log lines, the per-queue tally it writes as QueueStat
rows, what it says in an outage, and the outcome signals, sent on a thread of their own."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)

from django_pgjobs import schema, signals
from django_pgjobs.data import rows
from django_pgjobs.errors import first_line
from django_pgjobs.models import DURATION_BUCKETS, LATENCY_BUCKETS, Job, QueueStat
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.runtime import policy

logger = logging.getLogger(__name__)
# The lines about jobs and the worker's activity are the worker's own.
worker_logger = logging.getLogger("django_pgjobs.runtime.worker")


# ---- log lines ----------------------------------------------------------------------------------


def log_safely(log: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """`log(*args, **kwargs)` (a logger's method), whatever the application's logging does with
    it. Python's logging calls filters outside its own guard, so a filter that raises (one that
    reads `record.request`, say, on a record that has none) raises in the thread that logs: a
    line about a job, or about an error being handled, must not stop a worker's loop or end one
    of its threads. The line is lost; the application's filter is what drops it. SystemExit too
    (a filter that calls sys.exit): a worker stops when it is told to, not from a log line."""
    with contextlib.suppress(Exception, SystemExit):
        log(*args, **kwargs)


def log_outcome(job: Job, handled: Handled, outcome: Outcome) -> None:
    """A line for a failed, dead-lettered or cancelled attempt (successes at DEBUG), with the
    job's fields as extras for structured log handlers; never raises (see `log_safely`)."""
    # Nothing is built for an outcome that logs no line (a success above DEBUG, the common
    # case): the extras alone cost more than the rest of settling a no-op job.
    if outcome is Outcome.SUCCEEDED:
        if worker_logger.isEnabledFor(logging.DEBUG):
            extra = _extra(job, handled)
            log_safely(worker_logger.debug, "job %s (%s) succeeded", job.pk, job.task, extra=extra)
        return
    if outcome is Outcome.LOST:
        log_safely(
            worker_logger.warning,
            "job %s (%s): its outcome (%s) was not recorded: the worker no longer held its claim "
            "(its lease ran out, the process stalled or the database was out of reach; another "
            "worker may have run it again)",
            job.pk, job.task, handled.verdict.value, extra=_extra(job, handled),
        )  # fmt: skip
        return
    if handled.verdict is not Verdict.ERROR:
        return
    assert handled.failure is not None
    extra = _extra(job, handled) | {"error": handled.failure.summary, "status": outcome.value}
    if outcome is Outcome.CANCELLED:
        log_safely(worker_logger.info, "job %s (%s) cancelled", job.pk, job.task, extra=extra)
        return
    dead = outcome is Outcome.FAILED
    log_safely(
        worker_logger.error if dead else worker_logger.info,
        "job %s (%s) attempt %d failed: %s%s", job.pk, job.task, job.attempts,
        handled.failure.summary, "; dead-lettered" if dead else "", extra=extra,
    )  # fmt: skip


def _extra(job: Job, handled: Handled) -> dict[str, object]:
    return {
        "job_id": str(job.pk),
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempts,
        "duration": round(handled.duration, 6),
    }


#: A rate over less time than this says little (a --once run of a few jobs): none is shown.
MIN_RATE_SECONDS = 1.0


def log_activity(activity: ActivityTally, seconds: float, in_flight: int) -> None:
    """One line of what the worker did over the last `seconds`."""
    if activity.queues or in_flight:
        done, dead = activity.total(Outcome.SUCCEEDED), activity.total(Outcome.FAILED)
        log_safely(
            worker_logger.info,
            "last %s: done=%d retried=%d dead=%d cancelled=%d lost=%d in_flight=%d%s",
            _span(seconds), done, activity.total(Outcome.RETRIED), dead,
            activity.total(Outcome.CANCELLED), activity.total(Outcome.LOST), in_flight,
            rate(done + dead, seconds),
        )  # fmt: skip


def rate(jobs: int, seconds: float) -> str:
    """ " (231 jobs/s)", " (0.3 jobs/s)": two significant digits below 10 a second, so that
    3 jobs in 10 s do not read as 0; nothing for a span under MIN_RATE_SECONDS or no jobs."""
    if seconds < MIN_RATE_SECONDS or not jobs:
        return ""
    per_second = jobs / seconds
    shown = f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.2g}"
    return f" ({shown} jobs/s)"


def _span(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"


# ---- the activity tally, written as QueueStat rows ----------------------------------------------


@dataclass
class QueueTally:
    """One queue's counts since the worker's last report."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    lost: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    #: Per task run in the queue: its outcomes and its run durations (QueueStat.tasks).
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def ran(self, task: str, outcome: str, duration: float) -> None:
        counts = self.tasks.get(task)
        if counts is None:
            counts = self.tasks[task] = {
                "succeeded": 0, "retried": 0, "failed": 0,
                "durations": [0] * (len(DURATION_BUCKETS) + 1),
            }  # fmt: skip
        counts[outcome] += 1
        counts["durations"][bisect_left(DURATION_BUCKETS, duration)] += 1


class ActivityTally:
    """Per-queue counts, kept by the worker's main thread and replaced by a new tally at each
    report. The counts and claim latencies go to the table as a few rows per interval, so that
    reports never scan the job table for them (observability's stats.activity_stats reads them
    back)."""

    def __init__(self) -> None:
        self.queues: dict[str, QueueTally] = {}

    def _of(self, queue: str) -> QueueTally:
        counts = self.queues.get(queue)
        if counts is None:
            counts = self.queues[queue] = QueueTally()
        return counts

    def claimed(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            counts = self._of(job.queue)
            counts.claimed += 1
            if job.started_at is not None:
                latency = (job.started_at - job.run_at).total_seconds()
                counts.latency_buckets[bisect_left(LATENCY_BUCKETS, latency)] += 1

    def finished(self, job: Job, outcome: str, duration: float) -> None:
        counts = self._of(job.queue)
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        if outcome in ("succeeded", "retried", "failed"):
            counts.ran(job.task, outcome, duration)

    def total(self, outcome: str) -> int:
        return sum(getattr(counts, outcome) for counts in self.queues.values())

    def rows(
        self, worker: str, seconds: float, queues: Sequence[str], stopping: bool = False
    ) -> list[QueueStat]:
        """A QueueStat per queue served or seen, idle ones included (they say who is alive);
        `stopping`: the worker's last report, followed by a row of `seconds = 0` per queue served,
        which says it stopped (a report covers some time; these cover none)."""
        names = dict.fromkeys([*queues, *self.queues])
        goodbye = [QueueStat(seconds=0, worker=worker, queue=name) for name in queues]
        return [
            QueueStat(
                seconds=seconds,
                worker=worker,
                queue=name,
                claimed=counts.claimed,
                succeeded=counts.succeeded,
                retried=counts.retried,
                failed=counts.failed,
                latency_buckets=counts.latency_buckets,
                tasks=counts.tasks or None,
            )
            for name in names
            for counts in [self.queues.get(name) or QueueTally()]
        ] + (goodbye if stopping else [])


# ---- outages ------------------------------------------------------------------------------------


class WorkerError(Exception):
    """The worker cannot run (with --once: the database is unreachable or not migrated)."""


class Outage:
    """Failures in a row of the statements of `who` (the worker's loop, or the relay): the
    database cannot be used, or a turn failed for another reason (a bug, ours or in the
    application's code it runs on that thread: a logging filter, a model signal's receiver).
    Retried with backoff, one line per attempt and the traceback once; with --once, one clear
    line and a non-zero exit (WorkerError)."""

    def __init__(self, who: str = "the worker loop", prefix: str = "") -> None:
        self.who, self.prefix = who, prefix  # prefix: the lines of another than the worker's
        self.failures = 0
        self.database = True  # whether the last failure was the database's

    def failed(self, error: Exception) -> float:
        """Log this failure; returns how long to wait before trying again."""
        self.failures += 1
        self.database = isinstance(error, DatabaseError)
        pause = policy.outage_pause(self.failures)
        if self.failures == 1:
            log_safely(
                logger.error, "%s%s; retrying in %.2fs", self.prefix, self.describe(error), pause,
                exc_info=error,
            )  # fmt: skip
        else:
            log_safely(
                logger.warning, "%s%s (attempt %d); retrying in %.1fs",
                self.prefix, self.describe(error), self.failures, pause,
            )  # fmt: skip
        return pause

    def over(self) -> None:
        if self.failures:
            what = "the database is back" if self.database else f"{self.who} runs again"
            log_safely(
                logger.info, "%s%s after %d failed attempts", self.prefix, what, self.failures
            )
            self.failures = 0

    def describe(self, error: Exception) -> str:
        """One line saying what is wrong and, where we know, what to do."""
        first = first_line(error)
        if not isinstance(error, DatabaseError):
            return f"error in {self.who}: {type(error).__qualname__}: {first}"
        # An undefined table or column: the schema is older than the code.
        if schema.is_not_migrated(error):
            return schema.explained(error)
        if rows.plan_unfit(error):  # prepared: runtime/sessions.py
            return (
                "a migration changed the job table under the worker's prepared statements; "
                "it reconnects, which prepares them again"
            )
        if "lock timeout" in first:
            return f"a statement waited too long for a lock held elsewhere ({first})"
        if rows.timed_out(error):  # a statement_timeout: QueryCanceled is an OperationalError
            return f"a statement ran out of time ({first})"
        if rows.rolled_back(error):  # the same: not the connection's fault
            return f"the database rolled a transaction back ({first})"
        if rows.refuses_writes(error):
            return (
                f"the database refuses writes ({first}): a standby, or read-only; after a "
                "failover the connection may have reached the old primary or a replica: "
                "connecting again"
            )
        if isinstance(error, OperationalError | InterfaceError):
            return f"cannot reach the database: {first}"
        return f"database error in {self.who}: {type(error).__name__}: {first}"


# ---- outcome signals ----------------------------------------------------------------------------

#: Signals waiting for a receiver that is slow or hangs: past this many, more are dropped (the
#: outcomes are recorded all the same), and the worker says how many.
BACKLOG = 10_000


class Announcer:
    """Sends outcome signals in order on one thread, started when a signal first has a
    receiver: a worker whose signals have none pays nothing. `announce` and `flush` are the
    worker's main thread's: the signals of one turn go to the thread together (one hand-off a
    turn, not one a job: with Prometheus' counters on every outcome, a hand-off per job cost
    a tenth of a drain's rate).

    The outcome of each recorded attempt (job_succeeded, job_failed, ...) and job_enqueued for
    the jobs of the periodic schedules' ticks (chores.Scheduler) go this way. Their receivers
    are the application's code: an alert to a chat server that does not answer, a query that
    waits on a lock, a `sys.exit()`. Sent from the worker's main thread, which records outcomes
    and keeps every lease, a receiver that hangs would let all the worker's leases run out (its
    jobs run twice), one that exits would end the worker, and one that leaves a transaction open
    on the main thread's connection would break the claims after it. On this thread, in the
    order the outcomes were recorded, it can only delay the signals after it."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[list[Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._batch: list[Callable[[], None]] = []  # this turn's signals, each ready to send
        self._lock = threading.Lock()  # guards _waiting
        self._waiting = 0  # handed over, not yet sent
        self._dropped = 0

    def announce(self, job: Job, handled: Handled, outcome: Outcome) -> None:
        """Add the signal of an attempt's recorded outcome to this turn's (none for one without
        receivers)."""
        signal = signals.SIGNAL_OF_OUTCOME.get(outcome)
        if signal is not None and signal.receivers:
            self._batch.append(partial(
                signals.announce, job, outcome,
                duration=handled.duration, error=handled.failure, delay=handled.delay,
            ))  # fmt: skip

    def enqueued(self, jobs: list[Job]) -> None:
        """Send job_enqueued for `jobs`, committed by the worker itself (a periodic tick's), as
        an enqueue would have (once the batch before it is sent)."""
        if signals.job_enqueued.receivers:
            self._batch.append(partial(signals.send, signals.job_enqueued, Job, jobs=jobs))
            self.flush()

    def flush(self) -> None:
        """Hand this turn's signals to the thread (dropped past BACKLOG waiting, saying so)."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        with self._lock:
            room = BACKLOG - self._waiting
            if len(batch) > room:
                self._drop(len(batch) - max(room, 0))
                batch = batch[: max(room, 0)]
            self._waiting += len(batch)
        if not batch:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._send, name="pgjobs-signals", daemon=True)
            self._thread.start()
        self._todo.put(batch)

    def stop(self, within: float) -> None:
        """Send the signals still waiting, for at most `within` seconds."""
        self.flush()
        if self._thread is None:
            return
        self._todo.put(None)
        self._thread.join(within)
        if self._thread.is_alive():
            log_safely(
                logger.warning,
                "not every outcome signal was sent: a receiver did not return within %gs", within,
            )  # fmt: skip

    def _drop(self, count: int) -> None:
        before, self._dropped = self._dropped, self._dropped + count
        if before == 0 or before // 1000 != self._dropped // 1000:
            log_safely(
                logger.warning,
                "%d outcome signals dropped: %d wait for a receiver that does not return",
                self._dropped, BACKLOG,
            )  # fmt: skip

    def _send(self) -> None:
        """Each turn's signals with its connections handled as Django handles a request's."""
        while (batch := self._todo.get()) is not None:
            _close_old_connections()
            for send in batch:
                try:
                    send()
                except BaseException as error:  # SystemExit, KeyboardInterrupt: send_robust lets
                    # them through; a receiver's bug, not a reason to stop sending
                    log_safely(logger.error, "a signal's receiver raised", exc_info=error)
                with self._lock:
                    self._waiting -= 1
            _close_old_connections()
        with contextlib.suppress(Exception):
            connections.close_all()


def _close_old_connections() -> None:
    """Django's, which may raise closing a broken connection: the thread must go on."""
    with contextlib.suppress(Exception):
        close_old_connections()
