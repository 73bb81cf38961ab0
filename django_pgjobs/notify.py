"""Wake-ups: NOTIFY after an enqueue commits, coalesced; LISTEN in the worker.

A notification only says "look now": the table is the source of truth and workers poll as well,
so a lost, suppressed or rolled-back notification delays a job by at most one poll interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.db import DatabaseError, connections, transaction

from django_pgjobs.conf import get_settings

logger = logging.getLogger(__name__)

#: The one channel every queue is announced on; the queue name travels as the payload, bound
#: as a parameter (never formatted into SQL).
CHANNEL = "pgjobs"

#: A queue notified this recently by this process is not notified again: busy workers need no
#: wake-up, and each NOTIFY's commit takes a cluster-wide lock that serialises commits.
COALESCE_SECONDS = 0.005

_last_sent: dict[tuple[str, str], float] = {}


def after_enqueue(db: str, queues: Iterable[str]) -> None:
    """Arrange one NOTIFY per queue for when the caller's transaction commits (or now)."""
    if not get_settings().NOTIFY:
        return
    connection = connections[db]
    if not connection.in_atomic_block:
        _send(db, set(queues))
        return
    # At most one callback per transaction: later enqueues add their queues to its set.
    pending: _Pending | None = getattr(connection, "_pgjobs_pending", None)
    if pending is None or not any(entry[1] is pending for entry in connection.run_on_commit):
        pending = _Pending(db)
        connection._pgjobs_pending = pending  # type: ignore[attr-defined]
        transaction.on_commit(pending, using=db, robust=True)
    pending.queues.update(queues)


class _Pending:
    def __init__(self, db: str) -> None:
        self.db = db
        self.queues: set[str] = set()

    def __call__(self) -> None:
        _send(self.db, self.queues)


def _send(db: str, queues: set[str]) -> None:
    now = time.monotonic()
    due = [q for q in queues if now - _last_sent.get((db, q), -1.0) >= COALESCE_SECONDS]
    if not due:
        return
    for queue in due:
        _last_sent[(db, queue)] = now
    try:
        with connections[db].cursor() as cursor:
            cursor.execute(
                "SELECT pg_notify(%s, queue) FROM unnest(%s::text[]) AS queue", [CHANNEL, due]
            )
    except DatabaseError:
        # The jobs are committed; without the wake-up they wait for the next poll.
        logger.warning("could not send a wake-up for queues %s", due, exc_info=True)


def listen(
    db: str, on_notify: Callable[[str], None], on_connect: Callable[[], None],
    stopping: Callable[[], bool],
) -> None:  # fmt: skip
    """LISTEN on a dedicated connection until `stopping()`; reconnect with backoff on errors.

    Calls on_notify(queue) for each notification and on_connect() after every (re)connect, so
    the worker polls at once for whatever it missed while disconnected.
    """
    wrapper = connections[db]
    failures = 0
    while not stopping():
        try:
            connection: Any = wrapper.get_new_connection(wrapper.get_connection_params())
            try:
                connection.autocommit = True
                connection.execute(f"LISTEN {CHANNEL}")
                failures = 0
                on_connect()
                while not stopping():
                    for notification in connection.notifies(timeout=0.5):
                        on_notify(notification.payload)
            finally:
                connection.close()
        except Exception:
            failures += 1
            delay = min(5.0, 0.1 * 2**failures)
            logger.warning("wake-up listener lost its connection; retrying in %.1fs", delay)
            time.sleep(delay)
