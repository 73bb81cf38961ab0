"""Wake-ups sent by enqueue: which queues an enqueue announces (NOTIFY, delivered at commit).

A notification only says "look now": the table is the source of truth and workers poll as well,
so a lost, suppressed or rolled-back notification delays a job by at most one poll interval.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from django_pgjobs.conf import get_settings

#: The one channel every queue is announced on; the queue name is its payload, a bound parameter.
CHANNEL = "pgjobs"

#: A queue notified this recently by this process is not notified again: busy workers need no
#: wake-up, and each NOTIFY's commit takes a cluster-wide lock that serialises commits.
COALESCE_SECONDS = 0.005

_last_sent: dict[tuple[str, str], float] = {}


def to_send(db: str, queues: Iterable[str]) -> list[str]:
    """The queues an enqueue about to run on `db` should announce: those this process has not
    announced in the last COALESCE_SECONDS (none when PGJOBS["NOTIFY"] is off). The enqueue's
    own statement sends them, so they are delivered at commit and dropped on rollback."""
    if not get_settings().NOTIFY:
        return []
    now = time.monotonic()
    due = [q for q in queues if now - _last_sent.get((db, q), -1.0) >= COALESCE_SECONDS]
    for queue in due:
        _last_sent[(db, queue)] = now
    return due
