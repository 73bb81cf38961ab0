"""A worker's view of its queues' controls (Queue rows: paused, max_running), read every
second, and how one turn's claim is shared between open queues and limited ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from django_pgjobs.models import Queue

logger = logging.getLogger(__name__)


class QueueControls:
    """Which of `queues` are claimed freely (open), under a limit (limited), or not at all."""

    def __init__(self, queues: Sequence[str], interval: float) -> None:
        self.queues = list(queues)
        self.open: list[str] = list(queues)
        self.limited: list[str] = []
        self.interval = interval
        self._next_at = 0.0
        self._turns = 0

    def read_if_due(self, db: str) -> bool:
        """Read the controls when a second has passed; True when a queue was resumed (so the
        worker looks at once)."""
        now = time.monotonic()
        if now < self._next_at:
            return False
        self._next_at = now + self.interval
        controls = Queue.objects.using(db).filter(name__in=self.queues)
        # A max_running of 0 runs nothing: as paused, whatever carries the queue (for NATS, no
        # consumer can be limited to 0 messages: it is not fetched from at all).
        paused = {
            queue.name
            for queue in controls
            if queue.paused or (queue.max_running is not None and queue.max_running <= 0)
        }
        limited = {queue.name for queue in controls if queue.max_running is not None}
        before = set(self.open)
        self.open = [q for q in self.queues if q not in paused | limited]
        self.limited = [q for q in self.queues if q in limited - paused]
        if paused:
            logger.debug("paused queues: %s", ", ".join(sorted(paused)))
        return bool(set(self.open) - before)

    def open_share(self, wanted: int) -> int:
        """Of `wanted` jobs this turn, how many the open queues may take before the limited ones
        had their share: all of them without limited queues, else their share by number of
        queues, so that a backlog in an open queue never starves a limited one. The worker
        claims the limited queues' share first, and the open queues get what that leaves. The
        rounding takes turns, so one open and one limited queue alternate a single slot."""
        if not self.limited:
            return wanted
        if not self.open:
            return 0
        total = len(self.open) + len(self.limited)
        self._turns += 1
        return (wanted * len(self.open) + self._turns % total) // total
