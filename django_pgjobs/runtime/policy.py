"""The worker's timing decisions as plain functions: how much to prefetch, when to poll next,
when finished outcomes are worth a statement, and how long a stop waits."""

from __future__ import annotations

import os
import sys
import time

#: Longest a finished job's outcome waits for others to share its statement (see settle_due).
SETTLE_DELAY = 0.002

#: A worker claims more jobs than it has threads only as many as those threads are expected to
#: start within this many seconds (from the handlers' recent mean duration): fast jobs then never
#: wait for a round trip to the database, and slow ones are never hoarded from other workers.
PREFETCH_HORIZON = 0.05

#: A handler thread whose job has run this long is not counted on to start another soon: the
#: prefetch leaves it out, and once every thread is held up so, the jobs claimed for them and
#: not started go back to ready for other workers (instead of waiting, leases renewed, for as
#: long as the slowest handler runs).
BUSY_AFTER = 1.0

#: The longest pause between tries while the database is unreachable.
OUTAGE_BACKOFF_MAX = 30.0

#: How long after its own statements work again (after an outage, or a lock on the job table:
#: VACUUM FULL, a table-rewriting ALTER TABLE) a worker takes back no expired lease. The same
#: trouble held up every worker's heartbeats, so leases ran out under live handlers; the lease
#: keepers renew them once they get through, each within its statement's lock_timeout plus its
#: retry pause (5 s at most each, runtime/sessions.py and runtime/leases.py). A reaper that got
#: through first took back the jobs of every other worker: run twice, their outcomes refused.
REAP_RECOVERY = 15.0

#: A turn's statement that took longer than this waited for something (a lock on the job table,
#: most likely): a worker that has not reaped yet holds back as after trouble (Reaper.stalled).
STALLED = 0.5


def grace_left(grace: float, deadline: float) -> float:
    """What is left of a stop's grace period ending at `deadline` (monotonic; all of it when
    the worker ended by itself, `deadline` infinite), a second at least: what the worker gives
    the last of its outcome signals."""
    return max(1.0, min(grace, deadline - time.monotonic()))


def prefetch(concurrency: int, batch_size: int, mean_duration: float | None) -> int:
    """How many jobs beyond the threads to hold: what they start within PREFETCH_HORIZON."""
    if mean_duration is None:
        return 0
    expected = concurrency * PREFETCH_HORIZON / max(mean_duration, 1e-6)
    return min(batch_size, int(expected))


def mean_duration(previous: float | None, durations: list[float]) -> float | None:
    """The handlers' recent mean duration: an exponential average over turns."""
    if not durations:
        return previous
    mean = sum(durations) / len(durations)
    return mean if previous is None else 0.8 * previous + 0.2 * mean


def poll_delay(previous: float, claimed: int, wanted: int, poll_interval: float) -> float:
    """Seconds until the next poll: at once after a full batch, soon after the queue just ran
    dry, and backing off towards `poll_interval` while it stays empty."""
    if claimed == wanted:
        return 0.0
    if claimed:
        return 0.05
    return min(poll_interval, max(0.05, previous * 2))


def settle_due(
    pending: int, in_flight: int, concurrency: int, batch_size: int, waited: float
) -> bool:
    """Whether to record `pending` finished outcomes now, or let a few more handlers finish
    first so that one statement covers them all.

    Handlers finish one by one; settling each as it comes would split the worker's batches into
    ever smaller claims. So while other handlers still run, wait up to SETTLE_DELAY for them
    (a full batch is settled at once).
    """
    if not pending or pending == in_flight:
        return True  # nothing to wait for: settle (and claim) now
    if pending >= min(concurrency, batch_size):
        return True
    return waited >= SETTLE_DELAY


def doubling(first: float, failures: int, cap: float) -> float:
    """A pause after `failures` failures in a row: `first` after the first, twice as long after
    each further one, at most `cap`."""
    return min(cap, first * 2.0 ** min(max(failures - 1, 0), 30))


def outage_pause(failures: int) -> float:
    """How long to wait before trying the database again after `failures` failures in a row."""
    return doubling(0.1, failures, OUTAGE_BACKOFF_MAX)


def resident_mb() -> float:
    """This process's resident memory in MB (Linux: now; elsewhere: its peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource  # not on Windows; only reached where /proc is missing

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
