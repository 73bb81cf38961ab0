"""A worker's view of its queues' controls (Queue rows: paused, max_running), read every
second, and how one turn's claim is shared between open queues and limited ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections, transaction

from django_pgjobs.data import rows, sql
from django_pgjobs.errors import first_line
from django_pgjobs.models import Queue
from django_pgjobs.runtime.reporting import log_safely

logger = logging.getLogger(__name__)


class QueueControls:
    """Which of `queues` are claimed freely (open), under a limit (limited), or not at all."""

    def __init__(self, queues: Sequence[str], interval: float) -> None:
        self.queues = list(queues)
        # None claimed from until the controls were read once (a worker started while they
        # cannot be read must not claim from a paused queue).
        self.open: list[str] = []
        self.limited: list[str] = []
        self.interval = interval
        self._next_at = 0.0
        self._turns = 0
        self._stale = False  # the last read found the table locked

    def read_if_due(self, db: str) -> bool:
        """Read the controls when a second has passed; True when a queue was resumed (so the
        worker looks at once)."""
        now = time.monotonic()
        if now < self._next_at:
            return False
        self._next_at = now + self.interval
        try:
            # Not for long behind a lock on the table (sql.BRIEF_LOCK_TIMEOUT): the controls as
            # last read stand meanwhile, and the open queues are claimed from as ever.
            with transaction.atomic(using=db), connections[db].cursor() as cursor:
                cursor.execute(sql.BRIEF_LOCK_TIMEOUT)
                controls = list(Queue.objects.using(db).filter(name__in=self.queues))
        except DatabaseError as error:
            if not rows.timed_out(error):
                raise
            if not self._stale:
                log_safely(
                    logger.warning,
                    "the queue controls cannot be read (%s): as last read until they can",
                    first_line(error),
                )
            self._stale = True
            return False
        if self._stale:
            log_safely(logger.info, "the queue controls can be read again")
            self._stale = False
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
