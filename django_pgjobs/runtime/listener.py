"""The worker's wake-up listener: LISTEN on a dedicated connection (data/wakeups.py sends). Its
thread lives as long as the worker: whatever ends a connection, or the application's logging
configuration does (runtime/logs.py, quietly), it connects again after a pause."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from django_pgjobs.data.wakeups import CHANNEL
from django_pgjobs.runtime import policy
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime.reporting import quietly

logger = logging.getLogger(__name__)


def listen(
    db: str, on_notify: Callable[[str], None], on_connect: Callable[[], None],
    stopping: Callable[[], bool], name: str = "",
) -> None:  # fmt: skip
    """LISTEN on a dedicated connection (its application_name `name`, when given and the
    database's OPTIONS name none) until
    `stopping()`; reconnect with backoff on errors, whatever they are.

    Calls on_notify(queue) for each notification and on_connect() after every (re)connect, so
    the worker polls at once for whatever it missed while disconnected.
    """
    locks.unpooled(db)  # a connection of its own, not one of a Django pool's
    wrapper = connections[db]
    failures = 0
    while not stopping():
        try:
            params = wrapper.get_connection_params()
            if name and not params.get("application_name"):  # a name from OPTIONS is kept
                params["application_name"] = name
            connection: Any = wrapper.get_new_connection(params)
            try:
                connection.autocommit = True
                # Frozen, this process would hold back the server's notification queue; idle, it
                # is by design (runtime/locks.py).
                if not locks.pooled(db):
                    connection.execute(
                        "SELECT set_config('tcp_user_timeout', %s, false), "
                        "set_config('idle_session_timeout', %s, false)",
                        [locks.user_timeout(db), locks.IDLE_SESSION],
                    )
                connection.execute(f"LISTEN {CHANNEL}")
                on_connect()
                failures = 0
                while not stopping():
                    for notification in connection.notifies(timeout=0.5):
                        on_notify(notification.payload)
            finally:
                connection.close()
        # BaseException: this thread ends only when the worker stops; nothing else tells the
        # worker that wake-ups stopped coming (it would fall back to polling, unnoticed).
        except BaseException as error:
            failures += 1
            delay = policy.doubling(0.2, failures, 5.0)
            quietly(
                logger.warning,
                "wake-up listener lost its connection (%s: %s); retrying in %.1fs",
                type(error).__name__, error, delay,
            )  # fmt: skip
            time.sleep(delay)
