"""Wake-ups: NOTIFY with an enqueue's commit, coalesced; LISTEN in the worker.

A notification only says "look now": the table is the source of truth and workers poll as well,
so a lost, suppressed or rolled-back notification delays a job by at most one poll interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.db import connections

from django_pgjobs.conf import get_settings

logger = logging.getLogger(__name__)

#: The one channel every queue is announced on; the queue name travels as the payload, bound
#: as a parameter (never formatted into SQL).
CHANNEL = "pgjobs"

#: A queue notified this recently by this process is not notified again: busy workers need no
#: wake-up, and each NOTIFY's commit takes a cluster-wide lock that serialises commits.
COALESCE_SECONDS = 0.005

_last_sent: dict[tuple[str, str], float] = {}


def to_send(db: str, queues: Iterable[str]) -> list[str]:
    """The queues an enqueue about to run on `db` should announce: those this process has not
    announced in the last COALESCE_SECONDS (none when PGJOBS["NOTIFY"] is off).

    The enqueue's own statement sends them (pg_notify), so PostgreSQL delivers them when the
    caller's transaction commits and drops them if it rolls back: no extra round trip, and the
    wake-up arrives the moment the job is visible. A rolled-back transaction still counts as
    having announced its queues, so a wake-up it suppressed costs at most one poll interval.
    """
    if not get_settings().NOTIFY:
        return []
    now = time.monotonic()
    due = [q for q in queues if now - _last_sent.get((db, q), -1.0) >= COALESCE_SECONDS]
    for queue in due:
        _last_sent[(db, queue)] = now
    return due


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
