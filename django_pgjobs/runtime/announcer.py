"""The signals a worker sends about its own work, on a thread of their own: the outcome of each
recorded attempt (job_succeeded, job_failed, ...) and job_enqueued for the jobs of the periodic
schedules' ticks (runtime/chores.py).

Their receivers are the application's code: an alert to a chat server that does not answer, a
query that waits on a lock, a `sys.exit()`. Sent from the worker's main thread, which records
outcomes and keeps every lease, a receiver that hangs would let all the worker's leases run out
(its jobs run twice), one that exits would end the worker, and one that leaves a transaction
open on the main thread's connection would break the claims after it. On this thread, in the
order the outcomes were recorded, it can only delay the signals after it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from functools import partial

from django.db import close_old_connections, connections

from django_pgjobs import signals
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome
from django_pgjobs.runtime.logs import quietly

logger = logging.getLogger(__name__)

#: Signals waiting for a receiver that is slow or hangs: past this many, more are dropped (the
#: outcomes are recorded all the same), and the worker says how many.
BACKLOG = 10_000


class Announcer:
    """Sends outcome signals in order on one thread, started when a signal first has a
    receiver: a worker whose signals have none pays nothing. `announce` and `flush` are the
    worker's main thread's: the signals of one turn go to the thread together (one hand-off a
    turn, not one a job: with Prometheus' counters on every outcome, a hand-off per job cost
    a tenth of a drain's rate)."""

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
            quietly(
                logger.warning,
                "not every outcome signal was sent: a receiver did not return within %gs", within,
            )  # fmt: skip

    def _drop(self, count: int) -> None:
        before, self._dropped = self._dropped, self._dropped + count
        if before == 0 or before // 1000 != self._dropped // 1000:
            quietly(
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
                    quietly(logger.error, "a signal's receiver raised", exc_info=error)
                with self._lock:
                    self._waiting -= 1
            _close_old_connections()
        with contextlib.suppress(Exception):
            connections.close_all()


def _close_old_connections() -> None:
    """Django's, which may raise closing a broken connection: the thread must go on."""
    with contextlib.suppress(Exception):
        close_old_connections()
