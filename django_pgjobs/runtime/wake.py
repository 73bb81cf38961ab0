"""A wake-up that a signal handler may give.

The worker's, supervisor's and NATS consumer's loops sleep until woken by a stop signal, a
NOTIFY or a chore. ``threading.Event.set()`` takes a lock that the interrupted thread itself
may hold (inside its own ``wait()`` or ``clear()``): a signal handler calling it there waits
forever on its own thread, and the process hangs on SIGTERM. ``queue.SimpleQueue.put()`` is
reentrant, made for signal handlers, so a wake-up is a token put in one.
"""

from __future__ import annotations

import queue


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
