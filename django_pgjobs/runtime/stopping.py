"""A worker's stop (SIGTERM, SIGINT, a limit reached): it stops taking jobs, gives those running
its grace period, and cuts short whatever it waits for; a second stop ends the grace at once.
Shared by the PostgreSQL worker and the NATS one."""

from __future__ import annotations

import time

from django_pgjobs.runtime.options import Options
from django_pgjobs.runtime.wake import Wake


class Stoppable:
    """What a worker's loop needs of its stop: `_stopping`, the grace's `_deadline`, and the
    `_wake` that a stop sets."""

    options: Options

    def __init__(self) -> None:
        self._wake = Wake()  # set by signal handlers too: see wake.py
        self._stopping = False
        self._deadline = float("inf")  # the grace's end, once stopping

    def stop(self, immediately: bool = False) -> None:
        """Stop claiming; finish in-flight jobs within the grace period (or release them now).
        Safe to call from a signal handler."""
        now = time.monotonic()
        self._deadline = now if self._stopping or immediately else now + self.options.grace
        self._stopping = True
        self._wake.set()

    def _pause(self, seconds: float) -> None:
        """Wait `seconds` after a failed turn. Only a stop ends the wait sooner (while stopping,
        the stop's deadline): not the wake-ups of finished handlers, notifications or a claim
        asked for again, which would make every failed turn the next one's cue."""
        stopping = self._stopping
        until = time.monotonic() + seconds
        while self._stopping == stopping:
            left = (min(until, self._deadline) if stopping else until) - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)
            self._wake.clear()
