"""The outcome signals of a worker's recorded attempts (job_succeeded, job_failed, ...), sent on
a thread of their own.

Their receivers are the application's code: an alert to a chat server that does not answer, a
query that waits on a lock, a `sys.exit()`. Sent from the worker's main thread, which records
outcomes and keeps every lease, a receiver that hangs would let all the worker's leases run out
(its jobs run twice), one that exits would end the worker, and one that leaves a transaction
open on the main thread's connection would break the claims after it. On this thread, in the
order the outcomes were recorded, it can only delay the signals after it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, NamedTuple

from django.db import close_old_connections, connections

from django_pgjobs import signals
from django_pgjobs.outcomes import Outcome

if TYPE_CHECKING:
    from django_pgjobs.data.records import Failure
    from django_pgjobs.models import Job

logger = logging.getLogger(__name__)

#: Signals waiting for a receiver that is slow or hangs: past this many, more are dropped (the
#: outcomes are recorded all the same), and the worker says how many.
BACKLOG = 10_000


class _Announcement(NamedTuple):
    job: Job
    outcome: Outcome
    duration: float
    error: Failure | None
    delay: float | None


class Announcer:
    """Sends outcome signals in order on one thread, started when a signal first has a
    receiver: a worker whose signals have none pays nothing."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[_Announcement | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._dropped = 0

    def announce(
        self,
        job: Job,
        outcome: Outcome,
        *,
        duration: float,
        error: Failure | None = None,
        delay: float | None = None,
    ) -> None:
        signal = signals.SIGNAL_OF_OUTCOME.get(outcome)
        if signal is None or not signal.receivers:
            return
        if self._todo.qsize() >= BACKLOG:
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                logger.warning(
                    "%d outcome signals dropped: %d wait for a receiver that does not return",
                    self._dropped, BACKLOG,
                )  # fmt: skip
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._send, name="pgjobs-signals", daemon=True)
            self._thread.start()
        self._todo.put(_Announcement(job, outcome, duration, error, delay))

    def stop(self, within: float) -> None:
        """Send the signals still waiting, for at most `within` seconds."""
        if self._thread is None:
            return
        self._todo.put(None)
        self._thread.join(within)
        if self._thread.is_alive():
            logger.warning(
                "not every outcome signal was sent: a receiver did not return within %gs", within
            )

    def _send(self) -> None:
        """Each signal with its connections handled as Django handles a request's."""
        while (item := self._todo.get()) is not None:
            close_old_connections()
            try:
                signals.announce(
                    item.job, item.outcome, duration=item.duration, error=item.error,
                    delay=item.delay,
                )  # fmt: skip
            except BaseException as error:  # SystemExit, KeyboardInterrupt: send_robust lets
                # them through; a receiver's bug, not a reason to stop sending
                logger.error("a receiver of %s raised", item.outcome, exc_info=error)
            close_old_connections()
        connections.close_all()
