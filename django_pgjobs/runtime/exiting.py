"""The end of a runjobs process: once its worker has stopped, the process exits, whatever its
handlers left behind.

Python's exit waits for every thread that is not a daemon and for the threads of every
`concurrent.futures` pool (its own exit function joins them). A handler that started either and
left it running would keep a stopped worker's process alive for good: a supervisor waiting to
replace it never does, `runjobs --once` under cron never ends, a deploy waits for its SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from django_pgjobs.runtime import execute
from django_pgjobs.runtime.reporting import quietly

logger = logging.getLogger("django_pgjobs.runtime.worker")

#: The longest a process waits for what its handlers left running, after its worker stopped.
#: Its --grace, when shorter: the time the operator gave the process to stop.
LINGER = 10.0


def exit_code(code: object) -> int:
    """The process's exit status for SystemExit's `code` (None, a number, or a message)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def bound(code: int, grace: float) -> None:
    """End this process with `code` if it is still running min(grace, LINGER) seconds (at least
    one) from now. A watch on a daemon thread: a process that exits as usual ends it unseen."""
    within = max(1.0, min(grace, LINGER))

    def watch() -> None:
        time.sleep(within)
        left = [
            thread.name for thread in threading.enumerate()
            if thread is not threading.main_thread() and thread is not threading.current_thread()
            and not thread.name.startswith("pgjobs")
        ]  # fmt: skip
        loops = (
            " (with the event loops of async handlers that left tasks ignoring their "
            "cancellation)" if execute.lingering() else ""
        )  # fmt: skip
        quietly(
            logger.warning,
            "the process is still running after its worker stopped (%gs): threads left by its "
            "handlers or their signals' receivers have not ended (%s)%s: Python's exit waits "
            "for threads that are not daemons and for concurrent.futures pools; exiting "
            "without them",
            within, ", ".join(repr(name) for name in left) or "none found", loops,
        )  # fmt: skip
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(code)

    threading.Thread(target=watch, name="pgjobs-exit", daemon=True).start()
