"""runjobs --reload: restart the worker (or the supervisor and its children) when Python files
change, with Django's autoreloader, stopping it as gracefully as a stop signal would."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from django.utils import autoreload

from django_pgjobs.runtime.lifecycle import STOP_SIGNALS


class Stops(Protocol):
    """What --reload stops: a worker or a supervisor."""

    def stop(self, immediately: bool = False) -> None: ...

    def signalled(self, signum: int) -> None: ...


def run(run: Callable[[], int], stoppers: list[Stops]) -> int:
    """Run `run` under Django's autoreloader: a parent process starts a child that runs it and
    watches the Python files, and starts it again when the child exits because one changed.

    Django's own parent (run_with_reloader) SIGKILLs its child on SIGTERM, which would leave the
    worker's jobs to their leases; this parent passes stop signals on instead, so the worker
    stops as it always does, and says so. The child stops its worker at once when a file
    changed, releasing the jobs, before it exits to be restarted. `stoppers`: what `run` runs."""
    if os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) != "true":
        return _parent()
    reloader = autoreload.get_reloader()
    codes: list[int] = []

    def inner() -> None:
        try:
            codes.append(run())
        finally:
            reloader.stop()  # stopped by a signal: the process ends with it

    def stop_at_exit() -> None:  # a file changed: the reloader exits the process
        for stopper in list(stoppers):
            stopper.stop(True)
        for _ in range(100):
            if codes:
                break
            time.sleep(0.1)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for stopper in list(stoppers):
            stopper.signalled(signum)

    # The worker runs on the reloader's thread; signals arrive on this one.
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    atexit.register(stop_at_exit)
    autoreload.start_django(reloader, inner)
    return codes[0] if codes else 0


def _parent() -> int:
    """Start the reloading child again whenever it exits because a file changed (status 3),
    passing stop signals on to it; return its exit status otherwise. Once a stop signal came,
    the child is not started again (a file changed as it stopped would have), and the status is
    0: the worker was stopped, as asked."""
    env = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    stopped: list[int] = []
    while True:
        # Its own session: a terminal's Ctrl-C reaches it once, through this process.
        child = subprocess.Popen(autoreload.get_child_arguments(), env=env, start_new_session=True)

        def forward(signum: int, frame: FrameType | None, child: Any = child) -> None:
            stopped.append(signum)
            child.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
        try:
            code = child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if stopped:
            # Ended by the signal passed on before it could handle it (still starting): a stop.
            return 0 if code in (3, -stopped[0]) else code
        if code != 3:
            return code
