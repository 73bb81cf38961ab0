"""Tasks and switches of the process-model crash tests (tests/crash/test_processes.py).

Imported by tests/tasks.py, so every runjobs process of the tests (supervisors and their
children) loads it while Django sets up. Two switches, read from the environment at import:

- PGJOBS_TEST_CRASH_CHILDREN=1: a supervisor's child (its command line carries
  --supervised-by) exits with code 3 here, before it can run anything: a crash loop that
  leaves the supervisor itself untouched.
- PGJOBS_TEST_RELOADABLE=<module>: that module is imported too (the --reload test writes it in
  a temporary folder on PYTHONPATH, so Django's autoreloader watches it).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from django_pgjobs import task

if os.environ.get("PGJOBS_TEST_CRASH_CHILDREN") and "--supervised-by" in sys.argv:
    os._exit(3)

if os.environ.get("PGJOBS_TEST_RELOADABLE"):
    importlib.import_module(os.environ["PGJOBS_TEST_RELOADABLE"])


@task(timeout=2, max_attempts=2)
def hangs(n: int) -> None:
    """Write ledger row n, then never return (and never look at cancel_requested())."""
    from tests.models import Execution

    Execution.objects.create(n=n, pid=os.getpid())
    threading.Event().wait()


@task
def stamp_version(n: int) -> None:
    """Write ledger row 1000 × VERSION + n, VERSION being that of the module named by
    PGJOBS_TEST_RELOADABLE as this process imported it (the --reload test rewrites it)."""
    from tests.models import Execution

    version = sys.modules[os.environ["PGJOBS_TEST_RELOADABLE"]].VERSION
    Execution.objects.create(n=version * 1000 + n, pid=os.getpid())


@task(max_attempts=7)
def kills_its_worker() -> None:
    """A poison job: its handler SIGKILLs the worker process running it, every attempt."""
    os.kill(os.getpid(), signal.SIGKILL)


@task(max_attempts=2)
def ends_its_worker_cleanly() -> None:
    """Its handler ends the worker process with status 0, as if it had been asked to stop."""
    os._exit(0)
