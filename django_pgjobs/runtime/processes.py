"""How runjobs runs as processes: the supervisor of --processes, the parent of --reload, and a
process's exit once its worker has stopped."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from django.core.management.base import CommandError
from django.db import DatabaseError, connections, router
from django.utils import autoreload

from django_pgjobs.models import Job
from django_pgjobs.runtime import execute, policy
from django_pgjobs.runtime.chores import own_backoffs
from django_pgjobs.runtime.lifecycle import STOP_SIGNALS, Exit, Wake, said_stop_signal, worker_id
from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.runtime.sessions import LockWaits

logger = logging.getLogger(__name__)
# What a worker's own process says as it exits is the worker's.
worker_logger = logging.getLogger("django_pgjobs.runtime.worker")


# ---- a process's exit ---------------------------------------------------------------------------

#: The longest a process waits for what its handlers left running, after its worker stopped.
#: Its --grace, when shorter: the time the operator gave the process to stop.
EXIT_PATIENCE = 10.0


def exit_code(code: object) -> int:
    """The process's exit status for SystemExit's `code` (None, a number, or a message)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def bound_exit(code: int, grace: float) -> None:
    """End this process with `code` if it is still running min(grace, EXIT_PATIENCE) seconds
    (at least one) from now. A watch on a daemon thread: a process that exits as usual ends it
    unseen.

    Python's exit waits for every thread that is not a daemon and for the threads of every
    `concurrent.futures` pool (its own exit function joins them). A handler that started either
    and left it running would keep a stopped worker's process alive for good: a supervisor
    waiting to replace it never does, `runjobs --once` under cron never ends, a deploy waits for
    its SIGKILL."""
    within = max(1.0, min(grace, EXIT_PATIENCE))

    def watch() -> None:
        time.sleep(within)
        left = [
            thread.name for thread in threading.enumerate()
            if thread is not threading.main_thread() and thread is not threading.current_thread()
            and not thread.name.startswith("pgjobs")
        ]  # fmt: skip
        loops = (
            " (with the event loops of async handlers that left tasks ignoring their "
            "cancellation)" if execute.lingering() else ""
        )  # fmt: skip
        log_safely(
            worker_logger.warning,
            "the process is still running after its worker stopped (%gs): threads left by its "
            "handlers or their signals' receivers have not ended (%s)%s: Python's exit waits "
            "for threads that are not daemons and for concurrent.futures pools; exiting "
            "without them",
            within, ", ".join(repr(name) for name in left) or "none found", loops,
        )  # fmt: skip
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(code)

    threading.Thread(target=watch, name="pgjobs-exit", daemon=True).start()


# ---- runjobs --processes: the supervisor --------------------------------------------------------

#: Children that died within CRASH_WINDOW seconds holding no job, past which the supervisor
#: gives up: a deployment whose workers cannot start or run at all. A child that died holding
#: jobs is not counted (it is restarted after the same growing pause): a job that kills its
#: worker is taken back after its backoff (JobManager.abandon) and becomes a dead letter once
#: its attempts run out; counted, it stopped the supervisor first, its attempts left.
CRASH_LIMIT = 5
CRASH_WINDOW = 60.0

#: A child still running this long after its grace ended (or after a second stop signal) cannot
#: act on its SIGTERM (stopped, frozen, stuck in a call that ignores signals): it is killed and
#: its jobs taken back, so that the supervisor's stop ends. Longer than a child's own wait for
#: what its handlers left running once its worker stopped (EXIT_PATIENCE), so that a child that
#: released everything is not killed on its way out.
KILL_MARGIN = EXIT_PATIENCE + 10.0


@dataclass
class Child:
    slot: int
    worker_id: str
    process: subprocess.Popen[bytes]


@dataclass
class Supervisor:
    """Runs `count` children, each ``python -m django runjobs *args``, and keeps them running.

    Each child is ``runjobs`` itself (its own connections, threads and LISTEN), started with a
    worker id the supervisor chose, so that when a child dies the supervisor takes back its
    running jobs at once (JobManager.abandon: the attempt is recorded as lost, due again now)
    instead of waiting for their leases. A child that dies is restarted with backoff; children
    that keep dying make the supervisor stop them all and exit non-zero. A child that exits to
    be recycled (Exit.RECYCLE) is replaced at once. SIGTERM or SIGINT stops every child
    gracefully; a second one, at once.
    """

    count: int
    args: Sequence[str]
    grace: float = 30.0  # the children's --grace
    children: dict[int, Child] = field(default_factory=dict)
    _stopping: int = 0  # stop signals received
    _kill_at: float = float("inf")  # when to kill the children still running, once stopping
    _killed: set[int] = field(default_factory=set)  # their pids
    _crashes: list[float] = field(default_factory=list)  # deaths holding no job
    _deaths: list[float] = field(default_factory=list)  # all of them: the restart pause
    _restart_at: dict[int, float] = field(default_factory=dict)  # slot → when to start again
    _wake: Wake = field(default_factory=Wake)  # set by signal handlers too
    _failed: bool = False

    def run(self) -> int:
        """Until stopped; returns the exit code (0 when every child stopped cleanly)."""
        main = threading.current_thread() is threading.main_thread()  # not under --reload
        handlers = (
            {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS} if main else {}
        )
        # Taking back a dead child's jobs must not hold up this loop (restarts, stop signals):
        # its statement skips rows locked elsewhere and waits for no lock on the table for long.
        db = router.db_for_write(Job)
        lock_waits = LockWaits(db, f"pgjobs supervisor {os.getpid()}")
        lock_waits.limit_this_thread()
        try:
            log_safely(
                logger.info, "supervisor %d starting %d worker processes", os.getpid(), self.count
            )
            for slot in range(self.count):
                self._start(slot)
            while self.children or (self._restart_at and not self._stopping):
                if self._stopping and time.monotonic() >= self._kill_at:
                    self._kill_children()
                self._reap_children()
                now = time.monotonic()
                for slot, at in list(self._restart_at.items()):
                    if at <= now and not self._stopping:
                        del self._restart_at[slot]
                        self._start(slot)
                self._wake.wait(0.05)
                self._wake.clear()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            lock_waits.stop()
            connections.close_all()
        return 1 if self._failed else 0

    def stop(self, immediately: bool = False) -> None:
        """Stop every child gracefully; called again (or `immediately`), at once. Safe from a
        signal handler."""
        self._stopping += 1
        if immediately and self._stopping == 1:
            self.stop()
        margin = KILL_MARGIN if self._stopping > 1 else self.grace + KILL_MARGIN
        self._kill_at = min(self._kill_at, time.monotonic() + margin)
        for child in self.children.values():
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        self._wake.set()

    def signalled(self, signum: int) -> None:
        """A stop signal came: say which, and what it does, then stop(). Safe from a signal
        handler."""
        said_stop_signal(logger, signum, again=self._stopping > 0, grace=self.grace)
        self.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled(signum)

    def _kill_children(self) -> None:
        for child in self.children.values():
            pid = child.process.pid
            if child.process.poll() is None and pid not in self._killed:
                self._killed.add(pid)
                log_safely(
                    logger.error,
                    "worker process %d did not stop when asked (its grace and %gs more, or %gs "
                    "after another stop signal); killing it", pid, KILL_MARGIN, KILL_MARGIN,
                )  # fmt: skip
                child.process.kill()

    def _start(self, slot: int) -> None:
        child_id = f"{worker_id()}/{slot}"
        command = [
            sys.executable, "-m", "django", "runjobs", *self.args,
            "--worker-id", child_id, "--supervised-by", str(os.getpid()),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            process = subprocess.Popen(command, env=env, start_new_session=True)
        except OSError as error:  # the interpreter gone in a deploy, no process left to fork
            self._crashed(slot, f"worker process {child_id} could not be started ({error})")
            return
        self.children[slot] = Child(slot, child_id, process)
        log_safely(logger.info, "worker process %d started as %s", process.pid, child_id)
        if self._stopping:  # a stop signal came while it was being started: it missed it
            process.send_signal(signal.SIGTERM)

    def _reap_children(self) -> None:
        for slot, child in list(self.children.items()):
            code = child.process.poll()
            if code is None:
                continue
            del self.children[slot]
            self._ended(child, code)

    def _ended(self, child: Child, code: int) -> None:
        pid = child.process.pid
        if code in (Exit.OK, Exit.RECYCLE):
            if code == Exit.RECYCLE and not self._stopping:
                log_safely(
                    logger.info, "worker process %d exited to be replaced; starting another", pid
                )
                self._restart_at[child.slot] = time.monotonic()
            elif not self._stopping:  # a clean exit nobody asked for: keep the slot filled
                log_safely(
                    logger.warning,
                    "worker process %d exited (code 0) though nobody asked it to; starting "
                    "another", pid,
                )  # fmt: skip
                self._take_back(child, f"worker process {pid} exited unasked")
                self._restart_at[child.slot] = time.monotonic()
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        held = self._take_back(child, f"worker process {pid} {how}")
        if self._stopping:
            # Our own SIGTERM ends a child still starting (before it could handle signals, so
            # before it claimed anything): that is a stop, not a failure.
            self._failed = self._failed or code != -signal.SIGTERM
            return
        self._crashed(child.slot, f"worker process {pid} {how}", held)

    def _crashed(self, slot: int, what: str, held: bool = False) -> None:
        """A child of `slot` died (`held`: holding jobs) or could not be started: start another
        after a pause that grows with the deaths of the last CRASH_WINDOW, or give up past
        CRASH_LIMIT of them holding no job."""
        now = time.monotonic()
        self._deaths = [at for at in self._deaths if at > now - CRASH_WINDOW] + [now]
        self._crashes = [at for at in self._crashes if at > now - CRASH_WINDOW]
        if not held:
            self._crashes.append(now)
        if len(self._crashes) > CRASH_LIMIT:
            log_safely(
                logger.error,
                "%s; worker processes died %d times in %gs; stopping them all",
                what, len(self._crashes), CRASH_WINDOW,
            )  # fmt: skip
            self._failed = True
            self.stop()
            return
        pause = policy.doubling(0.5, len(self._deaths), 30.0)
        log_safely(logger.error, "%s; starting another in %.1fs", what, pause)
        self._restart_at[slot] = now + pause

    def _take_back(self, child: Child, reason: str) -> bool:
        """The dead child's running jobs are ready again after their backoff, the attempt
        recorded as lost; whether it held any (False when they could not be taken back)."""
        try:
            taken = Job.objects.abandon(child.worker_id, reason)
            Job.objects.delay(own_backoffs(taken))
        except DatabaseError as error:
            log_safely(
                logger.error,
                "could not take back the jobs of %s (%s); they return when their leases expire",
                child.worker_id, str(error).strip().splitlines()[0],
            )  # fmt: skip
            connections.close_all()
            return False
        returned, failed = taken.returned, taken.failed
        if returned or failed:
            log_safely(
                logger.warning,
                "took back %d jobs of %s (%d dead-lettered): %s",
                returned + failed, child.worker_id, failed, reason,
            )  # fmt: skip
        return bool(returned or failed)


# ---- runjobs --reload ---------------------------------------------------------------------------


class Stops(Protocol):
    """What --reload stops: a worker or a supervisor."""

    def stop(self, immediately: bool = False) -> None: ...

    def signalled(self, signum: int) -> None: ...


def run_reloading(
    run: Callable[[], int], stoppers: list[Stops], check: Callable[[], object]
) -> int:
    """Run `run` under Django's autoreloader: a parent process starts a child that runs it and
    watches the Python files, and starts it again when the child exits because one changed.

    Django's own parent (run_with_reloader) SIGKILLs its child on SIGTERM, which would leave the
    worker's jobs to their leases; this parent passes stop signals on instead, so the worker
    stops as it always does, and says so. The child stops its worker at once when a file
    changed, releasing the jobs, before it exits to be restarted. `stoppers`: what `run` runs.

    As runserver's, the child does not end when the code cannot start: an error kept as Django
    set up (apps.py), one from `check` (the system checks) or one raised by `run` is said once,
    and the child waits for a file to change (that one's included) to start again, or for a
    stop signal to exit 0. The parent ends once stopped, with the child's status."""
    if os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) != "true":
        sys.exit(_reloading_parent())
    reloader = autoreload.get_reloader()
    codes: list[int] = []
    ended = threading.Event()  # what `run` ran has stopped, or it could not start

    def inner() -> None:
        try:
            autoreload.check_errors(lambda: codes.append(run()))()
        except Exception as error:
            _could_not_start(error)
        else:
            reloader.stop()  # stopped by a signal: the process ends with it
        finally:
            ended.set()

    def stop_at_exit() -> None:  # a file changed: the reloader exits the process
        for stopper in list(stoppers):
            stopper.stop(True)
        ended.wait(10)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for stopper in list(stoppers):
            stopper.signalled(signum)
        if ended.is_set():  # nothing runs: it could not start
            reloader.stop()

    main = inner
    try:
        # What runserver's inner_run does first; check_errors has the reloader watch the file
        # an error came from, a module that failed to import being in no sys.modules.
        autoreload.check_errors(autoreload.raise_last_exception)()
        autoreload.check_errors(check)()
    except Exception as error:
        _could_not_start(error)
        ended.set()
        main = ended.set  # nothing to run: the reloader only watches
    # The worker runs on the reloader's thread; signals arrive on this one.
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    atexit.register(stop_at_exit)
    autoreload.start_django(reloader, main)
    return codes[0] if codes else 0


def _could_not_start(error: Exception) -> None:
    """Say once why the reloading child runs nothing until a file changes."""
    waiting = "it starts again when a Python file changes (Ctrl-C or SIGTERM stops it)"
    if isinstance(error, CommandError):  # its message says it all (a check, a bad setting)
        log_safely(worker_logger.error, "runjobs could not start: %s\n%s", error, waiting)
    else:
        log_safely(worker_logger.exception, "runjobs could not start; %s", waiting)


def _reloading_parent() -> int:
    """Start the reloading child again whenever it exits because a file changed (status 3) or
    to be replaced (Exit.RECYCLE), passing stop signals on to it. A child that failed before
    its own reloader could watch (an error Django met as it set up: a models module, say) is
    started again once a Python file this process imported changes. Once a stop signal came,
    the child is not started again (a file changed as it stopped would have), and the status is
    0: the worker was stopped, as asked; or the child's, which said why it failed."""
    env = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    stopped: list[int] = []
    while True:
        # Its own session: a terminal's Ctrl-C reaches it once, through this process.
        child = subprocess.Popen(autoreload.get_child_arguments(), env=env, start_new_session=True)

        def forward(signum: int, frame: FrameType | None, child: Any = child) -> None:
            stopped.append(signum)
            child.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
        try:
            code = child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if stopped:
            # Ended by the signal passed on before it could handle it (still starting): a stop.
            return 0 if code in (3, -stopped[0]) else code
        if code == 0:  # --once: drained
            return 0
        if code not in (3, Exit.RECYCLE) and not _changed_after_failing(code, stopped):
            return 0


def _changed_after_failing(code: int, stopped: list[int]) -> bool:
    """Say that the child failed with `code`, then wait until a Python file this process
    imported changes (True), or a stop signal comes (False, the signal added to `stopped`)."""
    reloader = autoreload.StatReloader()
    seen = dict(reloader.snapshot_files())  # before the line: a change after it is seen
    log_safely(
        logger.error,
        "runjobs exited with status %d (the error above); it starts again when a Python file "
        "changes (Ctrl-C or SIGTERM stops it)", code,
    )  # fmt: skip

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        while not stopped:
            time.sleep(reloader.SLEEP_TIME)
            if dict(reloader.snapshot_files()) != seen:
                return True
        return False
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
