"""Where a worker's claims got to in each queue, so that its next claim starts there instead of
at the claim index's start, and when it sweeps from the start instead.

Why: the claim index keeps an entry for every job claimed since the last vacuum, and while a
long snapshot (a report, a backup, a replica's feedback) keeps vacuum from removing them, a
claim that starts at the index's start reads every one of them to find the few ready jobs
behind them: the longer the snapshot is held, the slower every claim (benchmark W6: a tenth of
the throughput after five minutes). A claim that starts after the last job this worker claimed
reads only what came after it.

What it costs: a job that becomes ready behind a position (its enqueue committed after a later
job's, or a stopping worker released it keeping its place) is not seen by those claims. Sweeps
find it: a claim from the start, at least every SWEEP_EVERY seconds and otherwise when the time
since the last sweep is SWEEP_FACTOR times what that sweep took. A sweep takes a few
milliseconds on a healthy table, so such a job waits at most about SWEEP_EVERY longer; under a
snapshot held for minutes a sweep takes longer and comes less often, so the claims keep their
pace and such a job waits longer (SWEEP_FACTOR times the sweep).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from django_pgjobs.data.records import Position

if TYPE_CHECKING:
    from django_pgjobs.models import Job

#: The longest a job ready behind a position waits for a sweep while sweeps are quick.
SWEEP_EVERY = 0.05
#: Sweeps take at most 1 / (1 + SWEEP_FACTOR) of a worker's claiming time.
SWEEP_FACTOR = 20


class Positions:
    """One worker's positions, by queue, and its sweep clock (used by its main thread only)."""

    def __init__(self) -> None:
        self._at: dict[str, Position] = {}
        self._next_sweep = 0.0
        self._sweeping = True

    def for_turn(self) -> Mapping[str, Position]:
        """The positions this turn's claim starts after: none when it is time to sweep."""
        self._sweeping = time.monotonic() >= self._next_sweep
        return {} if self._sweeping else self._at

    def poll_by(self, claimed: int, wanted: int) -> float:
        """When (time.monotonic()) the worker should claim again at the latest, after a turn
        that claimed `claimed` of the `wanted` jobs: at the next sweep when this turn started
        after its positions and came back short, since jobs behind them (an enqueue that woke
        the worker, committed after a later job was claimed) are found only by a sweep; else
        never (the worker's own poll schedule decides)."""
        if self._sweeping or claimed >= wanted:
            return float("inf")
        return self._next_sweep

    def turned(self, claimed: Sequence[Job], seconds: float) -> None:
        """Move past the jobs this turn claimed (in claim order), the turn having taken
        `seconds`."""
        for job in claimed:
            self._at[job.queue] = Position.of(job)
        if self._sweeping:
            self._next_sweep = time.monotonic() + max(SWEEP_EVERY, SWEEP_FACTOR * seconds)
