"""A worker's tally of what it did for each queue since its last report, written as QueueStat rows.

The counts and claim latencies go to the table as a few rows per interval, so that reports never
scan the job table for them (stats.activity_stats reads them back).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from django_pgjobs.models import LATENCY_BUCKETS, Job, QueueStat


@dataclass
class QueueTally:
    """One queue's counts since the worker's last report."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    lost: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


class ActivityTally:
    """Per-queue counts, kept by the worker's main thread and replaced by a new tally at each
    report."""

    def __init__(self) -> None:
        self.queues: dict[str, QueueTally] = {}

    def _of(self, queue: str) -> QueueTally:
        counts = self.queues.get(queue)
        if counts is None:
            counts = self.queues[queue] = QueueTally()
        return counts

    def claimed(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            counts = self._of(job.queue)
            counts.claimed += 1
            if job.started_at is not None:
                latency = (job.started_at - job.run_at).total_seconds()
                counts.latency_buckets[bisect_left(LATENCY_BUCKETS, latency)] += 1

    def finished(self, job: Job, outcome: str) -> None:
        counts = self._of(job.queue)
        setattr(counts, outcome, getattr(counts, outcome) + 1)

    def total(self, outcome: str) -> int:
        return sum(getattr(counts, outcome) for counts in self.queues.values())

    def rows(
        self, worker: str, seconds: float, queues: Sequence[str], stopping: bool = False
    ) -> list[QueueStat]:
        """A QueueStat per queue served or seen, idle ones included (they say who is alive);
        `stopping`: the worker's last report, followed by a row of `seconds = 0` per queue served,
        which says it stopped (a report covers some time; these cover none)."""
        names = dict.fromkeys([*queues, *self.queues])
        goodbye = [QueueStat(seconds=0, worker=worker, queue=name) for name in queues]
        return [
            QueueStat(
                seconds=seconds,
                worker=worker,
                queue=name,
                claimed=counts.claimed,
                succeeded=counts.succeeded,
                retried=counts.retried,
                failed=counts.failed,
                latency_buckets=counts.latency_buckets,
            )
            for name in names
            for counts in [self.queues.get(name) or QueueTally()]
        ] + (goodbye if stopping else [])
