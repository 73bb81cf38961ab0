"""A worker's life (runtime/lifecycle.py): the loops' wake-up, given by signal handlers (Wake)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from django_pgjobs.runtime.lifecycle import Wake

#: A thread woken by a handler of signals that arrive every 2 ms for two seconds, while it
#: waits and clears. With threading.Event, the handler's set() waits on the lock its own thread
#: holds in clear() or wait(): the process hangs (here: each new signal nests another blocked
#: handler until RecursionError), as a worker did on a second SIGTERM.
STORM = textwrap.dedent(
    """
    import os, signal, time
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_pgjobs.runtime.lifecycle import Wake
    wake = Wake()
    signal.signal(signal.SIGALRM, lambda *args: wake.set())
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    end = time.monotonic() + 2
    while time.monotonic() < end:
        wake.wait(0.001)
        wake.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)
    print("survived")
    """
)


def test_a_signal_handler_can_wake_a_loop_however_often_it_comes() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STORM], capture_output=True, text=True, timeout=30, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "survived"), done.stderr[-2000:]


def test_it_waits_like_an_event() -> None:
    wake = Wake()
    assert wake.wait(0) is False
    wake.set()
    assert wake.wait(0) is True
    assert wake.wait(0) is True  # still set until cleared
    wake.clear()
    started = time.monotonic()
    assert wake.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, wake.set).start()
    assert wake.wait(5) is True
