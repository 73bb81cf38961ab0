"""L1: the claim of a limited task's jobs at scale (`--only limits`): a backlog of `keys` limit
keys and `backlog` jobs of a task limited to 2 running per key, then claims of 10 timed one by
one, each claim's jobs finished before the next (a worker's turn), as a worker makes them
(JobManager.claim_keyed, its cursor carried from claim to claim)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

KEYED = "bench.tasks.keyed"
CLAIM = 10


def rows(cluster: Any, backlog: int, keys: int, claims: int, row: Callable[..., Any]) -> list[Any]:
    from bench import workloads
    from django_pgjobs.limits import TaskLimits
    from django_pgjobs.models import Job
    from django_pgjobs.registry import all_tasks

    workloads.reset(cluster)
    for start in range(0, backlog, 50_000):
        payloads = ({"key": n % keys} for n in range(start, min(start + 50_000, backlog)))
        Job.objects.bulk_enqueue(KEYED, payloads)
    with cluster.connect() as conn:
        conn.execute("VACUUM ANALYZE pgjobs_job")
    limits = TaskLimits.of(all_tasks())
    seconds, cursor = [], ("", "")
    for _ in range(claims):
        started = time.perf_counter()
        keyed = Job.objects.claim_keyed(
            "default", limits, worker="bench", limit=CLAIM, after=cursor
        )
        seconds.append(time.perf_counter() - started)
        cursor = keyed.cursor
        if keyed.claimed:
            Job.objects.settle_and_claim(keyed.claimed, [], [], worker="bench", limit=0)
    ms = sorted(s * 1000 for s in seconds)
    return [
        row(f"L1 claim of {CLAIM} over {keys:,} keys, {backlog:,} jobs: p50", statistics.median(ms),
            "ms", target="< 5 ms", met=statistics.median(ms) < 5,
            note=f"p95 {ms[int(len(ms) * 0.95)]:.2f} ms over {claims} claims"),
    ]  # fmt: skip
