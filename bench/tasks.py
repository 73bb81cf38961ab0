"""The benchmark's tasks: a no-op, one that fails its first attempt, one that stamps its start,
a no-op limited per key, and a batch's callback."""

from __future__ import annotations

import os
import threading
import time

from django_pgjobs import current_job, task

if os.environ.get("BENCH_TURN_TEXT") == "one":  # bench/ab.py claim: one text for every turn
    from django_pgjobs.data import sql

    sql.CLAIM = sql.SETTLE_AND_CLAIM

if os.environ.get("BENCH_METRICS") == "1":  # bench/ab.py signals: receivers on every outcome
    from django_pgjobs import metrics

    metrics.connect()

if os.environ.get("BENCH_ANNOUNCE") == "inline":  # bench/ab.py signals: on the main thread
    from django_pgjobs import signals
    from django_pgjobs.runtime.reporting import Announcer

    Announcer.announce = lambda self, *args, **kwargs: signals.announce(*args, **kwargs)  # type: ignore[method-assign]


@task
def noop() -> None:
    pass


@task
def batch_done(batch: dict[str, object]) -> None:
    """W3 batched's callback (bench/ab.py batches)."""


@task(concurrency_limit=2, limit_by="key")
def keyed(key: int) -> None:
    """L1's limited task (bench/limits.py)."""


@task(backoff=lambda attempts: 0.0)
def flaky(fail: bool = False) -> None:
    """Fails its first attempt when `fail`; retried at once (no backoff) so a drain sees it."""
    job = current_job()
    if fail and job is not None and job.attempts == 1:
        raise RuntimeError("failing once, as asked")


_lock = threading.Lock()
_out = None


@task
def stamp() -> None:
    """Append "<job id> <time handler started>" to $BENCH_STAMPS (the latency workload)."""
    started = time.time()
    global _out
    job = current_job()
    with _lock:
        if _out is None:
            _out = open(os.environ["BENCH_STAMPS"], "a", buffering=1)  # noqa: SIM115
        _out.write(f"{job.pk if job else '?'} {started:.6f}\n")
