"""A worker's options and its life: what wakes it, how it is told to stop or to recycle (a
limit reached), and the exit codes that say how it ended. A stop ends the grace's wait at once the
second time."""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from django_pgjobs.runtime import execute, handlers, policy
from django_pgjobs.runtime.reporting import log_safely


def worker_id() -> str:
    """Unique per process: host, pid and a random suffix (pids are reused, hosts are cloned)."""
    return f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class Options:
    queues: Sequence[str] = ("default",)
    concurrency: int = 10
    batch_size: int = 100
    lease: float | None = None  # default PGJOBS["LEASE"]
    grace: float = 30.0
    poll_interval: float = 2.0
    listen: bool = True
    once: bool = False
    reap_interval: float = 5.0
    promote_interval: float = 1.0  # how often due scheduled jobs join the claim index
    prune_interval: float = 60.0
    stats_interval: float = 10.0
    controls_interval: float = 1.0  # how often the Queue controls (pause, limits) are read
    worker_id: str | None = None  # given by a supervisor (runjobs --processes); else made up
    max_jobs: int | None = None  # recycle after recording this many outcomes
    max_memory_mb: float | None = None  # recycle when resident memory passes this
    parent_pid: int | None = None  # a supervisor's: stop when it is gone
    relay: bool = True  # publish the outbox of NATS queues (transports.py), if there are any
    yielding: bool = True  # queues with a budget yield to the application (runtime/controls.py)


class Exit(IntEnum):
    """How a worker ended: its process's exit code."""

    OK = 0  # stopped or drained, every job it held recorded or released
    UNRELEASED = 1  # stopped, but jobs it held could not be released (their leases expire)
    RECYCLE = 75  # stopped gracefully to be replaced: a limit of --max-jobs/--max-memory, or
    # abandoned handler threads piled up (runtime/handlers.py)


class Wake:
    """``set()`` from anywhere, a signal handler included; ``wait(timeout)`` returns at the
    first ``set()`` since the last ``clear()`` (at once if there was one), or after `timeout`."""

    def __init__(self) -> None:
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def set(self) -> None:
        self._tokens.put(None)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._tokens.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return False
        self._tokens.put(None)  # still set until cleared, as an Event would be
        return True

    def clear(self) -> None:
        while True:
            try:
                self._tokens.get_nowait()
            except queue.Empty:
                return


logger = logging.getLogger("django_pgjobs.runtime.worker")

#: The signals that stop a worker (and a supervisor, and the reloader, which pass them on).
#: SIGHUP too: a closed terminal or an orchestrator's hang-up stops it as SIGTERM does, not at
#: once with its jobs left running until their leases expire.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: The least a recycle waits for the running jobs to finish (or --grace, when longer), before
#: it releases them as a stop does: a job that runs longer than both is started again by the
#: next worker; one that never ends (no time limit) holds the recycle up only this long.
RECYCLE_PATIENCE = 60.0
#: Seconds between the lines saying what a recycle still waits for.
RECYCLE_NOTE_EVERY = 10.0

#: Seconds between looks at the supervisor and the memory limit (also while paused after a
#: failed turn: an orphaned worker stops during an outage too).
LIMITS_INTERVAL = 1.0


class Stoppable:
    """What a worker's loop needs of its stop: `_stopping`, the grace's `_deadline`, the
    `_wake` that a stop sets, and the looks at its limits (`_check_limits`)."""

    options: Options
    id: str
    _recorded: int  # outcomes recorded since it started
    _exit: Exit

    def __init__(self) -> None:
        self._wake = Wake()  # set by signal handlers too: see wake.py
        self._stopping = False
        self._finishing = False  # stopping to be recycled: its running jobs finish first
        self._deadline = float("inf")  # the grace's end, once stopping
        self._limits_at = 0.0  # when to look at the supervisor and the memory limit next
        self._memory_said = False
        self._noted_at = 0.0  # the last line saying what a recycle waits for

    def stop(self, immediately: bool = False) -> None:
        """Stop claiming; finish in-flight jobs within the grace period (or release them now).
        A stop after another ends the grace at once; one during a recycle makes it a stop, with
        at most the grace. Safe to call from a signal handler."""
        now = time.monotonic()
        again = self._stopping and not self._finishing
        if self._finishing:
            self._exit = Exit.OK  # stopped, not recycled
        self._deadline = (
            now if again or immediately else min(self._deadline, now + self.options.grace)
        )
        self._stopping, self._finishing = True, False
        self._wake.set()

    def signalled(self, signum: int) -> None:
        """A stop signal came: say which, and what it does, then stop(). Safe to call from a
        signal handler."""
        again = self._stopping and not self._finishing
        said_stop_signal(logger, signum, again=again, grace=self.options.grace)
        self.stop()

    def _recycle(self, why: str) -> None:
        """Stop to be replaced (Exit.RECYCLE): claim nothing more, give back what no thread has
        started, and let the running jobs finish within --grace or RECYCLE_PATIENCE, whichever
        is longer, then release what still runs. Released after the grace alone, a job whose
        memory took the worker past --max-memory-per-child, or a long one among short ones
        under --max-jobs-per-child, started again on the next worker without an attempt spent,
        and again after each recycle: it never finished. A stop signal meanwhile gives at most
        the usual grace."""
        if not self._stopping:
            log_safely(logger.info, "worker %s stops to be replaced: %s", self.id, why)
            self._exit = Exit.RECYCLE
            patience = max(self.options.grace, RECYCLE_PATIENCE)
            self._deadline = time.monotonic() + patience
            self._noted_at = time.monotonic()
            self._stopping = self._finishing = True
            self._wake.set()

    def _note_recycle(self, running: int) -> None:
        """While a recycle waits for running jobs: a line every RECYCLE_NOTE_EVERY seconds."""
        if self._finishing and running and time.monotonic() >= self._noted_at + RECYCLE_NOTE_EVERY:
            self._noted_at = time.monotonic()
            log_safely(
                logger.info,
                "worker %s waits for %d running jobs before it is replaced (%.0fs at most)",
                self.id, running, max(0.0, self._deadline - time.monotonic()),
            )  # fmt: skip

    def _check_abandoned(self, deadlines: handlers.Deadlines) -> None:
        """Recycle once as many threads as the worker has are left behind at time limits: handler
        threads abandoned, companions running an async handler's tasks that ignore their
        cancellation, and the hooks of a timed-out Django Task run aside (task_finished's
        receivers, handlers.run_hook_aside). Each may hold memory and a connection for good."""
        left = deadlines.abandoned_alive() + execute.lingering() + handlers.hooks_aside()
        if left >= self.options.concurrency:
            self._recycle(
                f"{left} threads were abandoned past their time limit (handlers, async handlers' "
                "tasks that ignore cancellation, timed-out Tasks' task_finished receivers), as "
                f"many as its --concurrency {self.options.concurrency}"
            )

    def _check_limits(self) -> None:
        """At most every LIMITS_INTERVAL: stop when the supervisor is gone; recycle past
        --max-memory-per-child (--max-jobs-per-child is counted where outcomes are)."""
        if time.monotonic() < self._limits_at:
            return
        self._limits_at = time.monotonic() + LIMITS_INTERVAL
        parent = self.options.parent_pid
        if parent is not None and os.getppid() != parent and not self._stopping:
            log_safely(
                logger.warning, "worker %s: its supervisor %d is gone; stopping", self.id, parent
            )
            self.stop()
        self._check_memory()

    def _check_memory(self) -> None:
        """Recycle past --max-memory-per-child: at every look at the limits, and after each
        turn that recorded outcomes (fast jobs grow a process far within a second)."""
        limit = self.options.max_memory_mb
        if not limit or (used := policy.resident_mb()) <= limit:
            return
        if self._recorded:
            self._recycle(f"it uses {used:.0f} MB (--max-memory-per-child {limit:g})")
        elif not self._memory_said:
            # Before its first outcome: a replacement would start as large and exit at once,
            # again and again, running nothing.
            self._memory_said = True
            log_safely(
                logger.error,
                "worker %s uses %.0f MB before its first job ended, over --max-memory-per-child "
                "%g: a replacement would too, so it is not replaced until it has recorded an "
                "outcome; raise the limit", self.id, used, limit,
            )  # fmt: skip

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` after a failed turn. Only a stop ends the wait sooner (while stopping,
        the stop's deadline): not the wake-ups of finished handlers, notifications or a claim
        asked for again, which would make every failed turn the next one's cue. The limits are
        looked at meanwhile: a worker orphaned during an outage stops within a second."""
        stopping = self._stopping
        until = time.monotonic() + seconds
        while self._stopping == stopping:
            left = (min(until, self._deadline) if stopping else until) - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(left, LIMITS_INTERVAL))
            self._wake.clear()
            self._check_limits()


def said_stop_signal(log_to: logging.Logger, signum: int, *, again: bool, grace: float) -> None:
    """The line for a stop signal received (by a worker, or by a supervisor for its children):
    which one, and what it does."""
    name = signal.Signals(signum).name
    if again:
        log_safely(log_to.warning, "%s again: releasing the running jobs now", name)
    else:
        log_safely(log_to.info, "%s: stopping; running jobs get %gs to finish", name, grace)
