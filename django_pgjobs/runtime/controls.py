"""A worker's view of its queues' controls (Queue rows: paused, max_running), read every
second; how one turn's claim is shared between open queues and limited ones; and how fast the
queues that yield to the application may claim (Yielding, Gauge)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections, transaction

from django_pgjobs import limits
from django_pgjobs.data import rows, sql
from django_pgjobs.errors import first_line
from django_pgjobs.models import Job, Queue
from django_pgjobs.observability.load import QUEUE_STATEMENT, WORKER_APPLICATION
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.reporting import log_safely

logger = logging.getLogger(__name__)


class QueueControls:
    """Which of `queues` are claimed freely (open), under a limit (limited), or not at all."""

    def __init__(self, queues: Sequence[str], interval: float) -> None:
        self.queues = list(queues)
        # None claimed from until the controls were read once (a worker started while they
        # cannot be read must not claim from a paused queue).
        self.open: list[str] = []
        self.limited: list[str] = []
        self.interval = interval
        self._next_at = 0.0
        self._turns = 0
        self._stale = False  # the last read found the table locked
        # Queues that yield to the application, by name (yield_to); the others never do.
        self.yielding: dict[str, Yielding] = {}
        self.gauge: Gauge | None = None
        #: How many jobs each queue may take this turn (admit).
        self.rooms: dict[str, int] = {}
        self._unreadable: set[str] = set()  # queues whose rate_limit was said to be unreadable

    def yield_to(self, db: str, budgets: dict[str, float | None], floor: float) -> Gauge:
        """Let the queues with a budget (`budgets`, by queue; None: never yield) yield to the
        application; returns the chore that reads its transactions."""
        by_budget: dict[float, list[str]] = {}
        for queue in self.queues:
            budget = budgets.get(queue)
            if budget is not None:
                by_budget.setdefault(budget, []).append(queue)
        groups = [Yielding(budget, floor, queues) for budget, queues in by_budget.items()]
        self.yielding = {queue: group for group in groups for queue in group.queues}
        self.gauge = Gauge(db, groups)
        return self.gauge

    def admit(self, wanted: int) -> int:
        """How many of `wanted` jobs this turn's claim may take: each queue's share in `rooms`
        (what its yielding allows, or all), and their sum (at most `wanted`)."""
        groups: dict[Yielding, int] = {}  # each group's room, shared by its queues
        free = 0
        self.rooms = {}
        for queue in [*self.open, *self.limited]:
            group = self.yielding.get(queue)
            if group is None:
                self.rooms[queue] = free = wanted
            else:
                if group not in groups:
                    groups[group] = group.room(wanted)
                self.rooms[queue] = groups[group]
        if not groups:
            return wanted
        return min(wanted, free + sum(groups.values()))

    def took(self, jobs: Sequence[Job], wanted: int) -> None:
        """Count the jobs a claim of `wanted` took against the yielding of their queues."""
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.queue] = counts.get(job.queue, 0) + 1
        for queue, count in counts.items():
            if (group := self.yielding.get(queue)) is not None:
                group.took(count)
        if wanted and self.gauge is not None:
            self.gauge.wanted(dry=len(jobs) < wanted)

    def yield_figures(self) -> dict[str, dict[str, float | None]]:
        """What each yielding queue's QueueStat row says of it since the last report."""
        gauge = self.gauge
        if gauge is None:
            return {}
        ms = {
            "open_ms": None if gauge.signal is None else gauge.signal * 1000,
            "baseline_ms": None if gauge.baseline is None else gauge.baseline * 1000,
        }
        return {
            queue: {"yielded": group.yielded, "allowed": group.rate, **ms}
            for queue, group in self.yielding.items()
        }

    def reported(self) -> None:
        for group in self.yielding.values():
            group.yielded = 0.0

    def next_in(self, wanted: int) -> float:
        """Seconds until a claim of up to `wanted` may take anything (0: now)."""
        queues = [*self.open, *self.limited]
        if not queues or any(queue not in self.yielding for queue in queues):
            return 0.0
        if self.gauge is not None:
            self.gauge.wanted()  # held back: the worker still wants jobs
        return min(self.yielding[queue].next_in(wanted) for queue in queues)

    def read_if_due(self, db: str) -> bool:
        """Read the controls when a second has passed; True when a queue was resumed (so the
        worker looks at once)."""
        now = time.monotonic()
        if now < self._next_at:
            return False
        self._next_at = now + self.interval
        try:
            # Not for long behind a lock on the table (sql.BRIEF_LOCK_TIMEOUT): the controls as
            # last read stand meanwhile, and the open queues are claimed from as ever.
            with transaction.atomic(using=db), connections[db].cursor() as cursor:
                cursor.execute(sql.BRIEF_LOCK_TIMEOUT)
                controls = list(Queue.objects.using(db).filter(name__in=self.queues))
        except DatabaseError as error:
            if not rows.timed_out(error):
                raise
            if not self._stale:
                log_safely(
                    logger.warning,
                    "the queue controls cannot be read (%s): as last read until they can",
                    first_line(error),
                )
            self._stale = True
            return False
        if self._stale:
            log_safely(logger.info, "the queue controls can be read again")
            self._stale = False
        # A max_running of 0 runs nothing: as paused, whatever carries the queue (for NATS, no
        # consumer can be limited to 0 messages: it is not fetched from at all).
        paused = {
            queue.name
            for queue in controls
            if queue.paused or (queue.max_running is not None and queue.max_running <= 0)
        }
        limited = {
            queue.name
            for queue in controls
            if queue.max_running is not None or limits.rate_or_none(queue.rate_limit) is not None
        }
        for queue in controls:  # written by other means than the form, which checks it
            if queue.rate_limit and limits.rate_or_none(queue.rate_limit) is None:
                if queue.name not in self._unreadable:
                    log_safely(
                        logger.warning,
                        "queue %s: its rate_limit %r is not a rate (as \"10/s\", \"100/m\"): it "
                        "runs without one",
                        queue.name, queue.rate_limit,
                    )  # fmt: skip
                self._unreadable.add(queue.name)
        before = set(self.open)
        self.open = [q for q in self.queues if q not in paused | limited]
        self.limited = [q for q in self.queues if q in limited - paused]
        if paused:
            logger.debug("paused queues: %s", ", ".join(sorted(paused)))
        return bool(set(self.open) - before)

    def open_share(self, wanted: int) -> int:
        """Of `wanted` jobs this turn, how many the open queues may take before the limited ones
        had their share: all of them without limited queues, else their share by number of
        queues, so that a backlog in an open queue never starves a limited one. The worker
        claims the limited queues' share first, and the open queues get what that leaves. The
        rounding takes turns, so one open and one limited queue alternate a single slot."""
        if not self.limited:
            return wanted
        if not self.open:
            return 0
        total = len(self.open) + len(self.limited)
        self._turns += 1
        return (wanted * len(self.open) + self._turns % total) // total


# ---- yielding to the application ------------------------------------------------------------

#: pg_stat_activity is read every SAMPLE seconds while the worker claims from a queue that
#: yields; each WINDOW of the database's clock is judged at its end, so that every worker's
#: windows line up.
SAMPLE, WINDOW = 0.05, 1.0
#: Until a window has seen the application, only every SAMPLE_ABSENT seconds: a drain with
#: nothing beside it pays for a few reads a second, not twenty.
SAMPLE_ABSENT = 0.25
#: Every PROBE_EVERY windows, every worker holds its yielding queues at their floor for one
#: window (the same one: the database's clock), and its end (PROBE_FROM onwards, once the jobs
#: claimed before have finished) measures the baseline afresh. A baseline learned while the
#: queue loads the database would excuse that load. The quiet level is the lower median of the
#: last PROBES_KEPT probes (a window held at the floor counts as one).
PROBE_EVERY, PROBE_FROM, PROBES_KEPT = 30, 0.4, 5
#: The weight of a window in which the worker kept up in the normal day's average, and how
#: many windows that average is kept after the worker last kept up (the probes' then).
NORMAL, NORMAL_KEPT = 0.1, 600
#: A window (or a probe) that saw fewer of the application's open transactions than this says
#: nothing of their baseline.
SEEN_AT_LEAST = 10
#: Transactions open longer than this are not the short ones customers wait on (a report, a
#: migration, a psql session left open): the signal leaves them out.
LONG_TRANSACTION = 5.0
#: The weight of a window in the smoothed signal: one window's sum swings by a third from the
#: next, the smoothed signal by a tenth.
SMOOTHING = 0.3
#: Over the budget, the allowed rate shrinks by as much as the signal is over it (limit /
#: signal), between DECREASE and DECREASE_MOST. Under half of the budget's margin it grows by
#: INCREASE (INCREASE_QUIET when the signal is under QUIET times the baseline: the application
#: mostly went away; a window's noise is a third of it), and by the floor in every window under
#: the budget: the additive part is what brings many workers to equal shares, as it does TCP's
#: flows.
DECREASE, DECREASE_MOST = 0.9, 0.5
INCREASE, INCREASE_QUIET, QUIET = 1.2, 1.5, 0.5
#: Seconds the signal may exceed the budget by before it counts: an application with a few
#: short transactions has a baseline of a few microseconds, and the sampling's noise.
SLACK = 0.0001
#: Windows over the budget in a row before a worker starts yielding: one is the noise's now and
#: then.
STARTS_AFTER = 2
#: Windows the limit must go unused (the worker wanted no more than it allowed) before it is
#: lifted.
UNUSED_WINDOWS = 3
#: Tokens a yielding queue group may save up (seconds of its rate), and the fewest a claim waits
#: for (seconds of its rate): one job per turn would cost a statement per job.
BURST, CHUNK = 0.1, 0.02

# The application's open transactions (and the sessions this role may not read: state NULL).
# The queue's own are left out as jobstats' share of the queue leaves them out
# (observability/load.py): named as a worker, or in a statement on the queue's tables.
OPEN_TRANSACTIONS = """
    SELECT extract(epoch FROM clock_timestamp())::float8,
           coalesce(array_agg(extract(epoch FROM clock_timestamp() - xact_start)::float8)
                    FILTER (WHERE state IS NOT NULL), '{}'),
           count(*) FILTER (WHERE state IS NULL
                            AND NOT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE'))
    FROM pg_stat_activity
    WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
      AND datname = current_database()
      AND (state IS NULL
           OR state <> 'idle' AND xact_start IS NOT NULL
              AND xact_start > clock_timestamp() - make_interval(secs => %(long)s)
              AND coalesce(application_name, '') NOT LIKE %(worker)s
              AND coalesce(query, '') NOT LIKE %(queue)s)
"""


class Yielding:
    """How many jobs a second a worker claims from the queues that yield with `budget`, at least
    `floor` (docs/explanation/yielding.md): no limit until the application's open transactions
    add up to more than their baseline × budget² (each open `budget` times as long), then a rate
    that shrinks while they do and grows back while they do not, lifted once the worker no
    longer uses it all."""

    def __init__(self, budget: float, floor: float, queues: Sequence[str]) -> None:
        self.budget, self.floor, self.queues = budget, floor * len(queues), list(queues)
        self.rate: float | None = None  # jobs/s; None: not yielding
        self.probing = False
        self.tokens = 0.0
        self.yielded = 0.0  # seconds spent yielding, since the last report
        self._filled = time.monotonic()
        self._took = 0  # in this window
        self._held = False  # in this window, the worker wanted more than it allowed
        self._unused = 0
        self._over = 0  # windows over the budget in a row
        self.usual: float | None = None  # jobs/s it claimed while it kept up, averaged

    def limit(self) -> float | None:
        """The rate allowed now (jobs/s), None for none."""
        return self.floor if self.probing else self.rate

    def room(self, wanted: int) -> int:
        """How many of `wanted` jobs may be claimed now."""
        rate = self.limit()
        if rate is None:
            return wanted
        now = time.monotonic()
        self.tokens = min(self.tokens + rate * (now - self._filled), max(1.0, rate * BURST))
        self._filled = now
        room = min(wanted, int(self.tokens + 1e-9))  # 0.05 s at 100/s is 5 tokens, not 4.99
        if room < wanted:
            self._held = True
        return room if room >= min(wanted, max(1.0, rate * CHUNK)) else 0

    def next_in(self, wanted: int) -> float:
        """Seconds until `room(wanted)` has a claim's worth."""
        rate = self.limit()
        if rate is None:
            return 0.0
        need = min(wanted, max(1.0, rate * CHUNK))
        return max(0.0, (need - self.tokens) / rate)

    def took(self, count: int) -> None:
        self._took += count
        if self.limit() is not None:
            self.tokens -= count

    def over(self, baseline: float, share: float = 1.0) -> float:
        """The most the signal may be without yielding more (with `share` of the budget). The
        signal adds up the open transactions' ages: at a steady load, when each stays open k
        times as long, there are k times as many open, each k times as old: k² in all."""
        return baseline * (1 + (self.budget - 1) * share) ** 2 + SLACK

    def judge(self, signal: float, baseline: float | None, kept_up: bool = False) -> str | None:
        """A window ended with the smoothed `signal` and the `baseline` (None: not measured
        yet); `kept_up`: the worker's claims came back short in it (no backlog). Returns
        "started" or "stopped" when the worker starts or stops yielding."""
        took, held = self._took, self._held
        self._took, self._held = 0, False
        if kept_up and self.rate is None:
            self.usual = _average(self.usual, took / WINDOW, NORMAL)
        if self.rate is not None:
            self.yielded += WINDOW
        limit = None if baseline is None else self.over(baseline)
        over = limit is not None and signal > limit
        self._over = self._over + 1 if over else 0
        far = limit is not None and signal > 2 * limit  # not the noise's: at once
        if over and (self.rate is not None or self._over >= STARTS_AFTER or far):
            assert limit is not None
            started = self.rate is None
            demand = took / WINDOW
            # As much less as it is over, as Gradient2 does, within bounds. Never below the
            # rate of its normal day: yielding slows a backlog's drain, and must not leave the
            # worker behind what is enqueued every day.
            factor = min(DECREASE, max(DECREASE_MOST, limit / signal))
            lowest = max(self.floor, self.usual or 0.0)
            self.rate = max(lowest, min(self.rate or demand, demand) * factor)
            self._unused = 0
            if started:
                return "started"
            return None
        if self.rate is None:
            return None
        if baseline is None or signal < baseline * QUIET:  # the application mostly went away
            growth = INCREASE_QUIET
        elif signal < self.over(baseline, share=0.5):
            growth = INCREASE
        else:
            growth = 1.0
        self.rate = self.rate * growth + self.floor
        self._unused = 0 if held else self._unused + 1
        if self._unused >= UNUSED_WINDOWS:
            self.rate = None
            return "stopped"
        return None


class Gauge(Chore):
    """The application's open transactions, as yielding reads them: sampled every SAMPLE seconds
    while the worker wants jobs, their ages added up per sample (the seconds they have been
    open, in all: at a steady load it grows with how long each stays open), averaged per WINDOW
    of the database's clock, smoothed, and judged against a baseline.

    The baseline is the application's normal day: the signal while the worker keeps up (its
    claims come back short: no backlog), averaged. A worker that has not kept up for
    PROBE_EVERY windows (a backlog from its start, or a long one) measures it instead in
    probes: every worker holds its yielding queues at their floor for the same window, and the
    end of it is the application with the queue quiet (a little less than its normal day)."""

    def __init__(self, db: str, groups: Sequence[Yielding]) -> None:
        super().__init__()
        self.db, self.groups = db, list(groups)
        self.signal: float | None = None  # smoothed; seconds
        self.normal: float | None = None  # while the worker kept up, averaged
        self.quiet: float | None = None  # in the probes: their median
        self.hidden = 0  # sessions of other roles this one may not read, when first seen
        self._kept_up_at: int | None = None  # the last window in which it kept up
        self._probes: list[float] = []
        self._window: int | None = None
        self._probe_at: int | None = None  # the next window that probes
        self._sums: list[float] = []  # per sample, in this window
        self._probed: list[float] = []  # per sample, in this window's part that probes
        self._seen = 0  # open transactions seen in this window
        self._dry = False  # in this window, a claim came back short
        self._present = False  # the last window saw the application
        self._wanted_at = 0.0

    @property
    def baseline(self) -> float | None:
        """The normal day, or the probes' quiet when that is higher (the application grew slower
        by itself: holding the queue back would not help it) or the normal day is unknown."""
        known = [value for value in (self.normal, self.quiet) if value is not None]
        return max(known) if known else None

    def wanted(self, dry: bool = False) -> None:
        """The worker claimed jobs of a yielding queue (`dry`: fewer than it asked for), or was
        held back: sample (again)."""
        self._dry = self._dry or dry
        now = time.monotonic()
        if now - self._wanted_at > SAMPLE:
            self._wanted_at = now
            self.next_at = min(self.next_at, now)

    def run(self) -> float:
        if time.monotonic() - self._wanted_at > 1.0:  # an idle worker loads nothing: no reads
            self.pause()
            return float("inf")
        self.sample()
        return SAMPLE if self._present else SAMPLE_ABSENT

    def sample(self) -> None:
        params: dict[str, float | str] = {
            "long": LONG_TRANSACTION,
            "worker": f"{WORKER_APPLICATION}%",
            "queue": f"%{QUEUE_STATEMENT}%",
        }
        with connections[self.db].cursor() as cursor:
            cursor.execute(OPEN_TRANSACTIONS, params)
            epoch, ages, hidden = cursor.fetchone()
        if hidden and not self.hidden:
            log_safely(
                logger.warning,
                "sessions of other database roles (%d) are hidden from this worker's role: it "
                "cannot yield to them (GRANT pg_read_all_stats TO the workers' role)", hidden,
            )  # fmt: skip
        self.hidden = self.hidden or hidden
        self.seen(epoch, ages)

    def seen(self, epoch: float, ages: Sequence[float]) -> None:
        """One sample: the database's clock (epoch seconds) and the open transactions' ages."""
        window, into = divmod(epoch, WINDOW)
        window = int(window)
        if window != self._window:
            if self._window is not None and window == self._window + 1:
                self._close(self._window)
            self._start(window)
        self._sums.append(sum(ages))
        self._seen += len(ages)
        if self.probing() and into >= PROBE_FROM * WINDOW:
            self._probed.append(sum(ages))

    def probing(self) -> bool:
        return self._window is not None and self._window == self._probe_at

    def pause(self) -> None:
        """The worker claims nothing: the window in progress is dropped (it would be judged
        against a gap)."""
        self._window = self._probe_at = None
        for group in self.groups:
            group.probing = False

    def _start(self, window: int) -> None:
        kept_up = self._kept_up_at is not None and window - self._kept_up_at < PROBE_EVERY
        # Probes only while the application is there: with nothing to yield to, a probe would
        # only slow the queue (a drain's first second, at its floor).
        present = self._present = self._window is not None and self._seen >= self._enough()
        if kept_up or not present:
            self._probe_at = None
        elif self.baseline is None:
            self._probe_at = window  # none yet: at once
        elif self._probe_at is None or self._probe_at < window:
            self._probe_at = window + (-window % PROBE_EVERY)  # all workers together
        self._window, self._sums, self._probed, self._seen = window, [], [], 0
        self._dry = False
        for group in self.groups:
            group.probing = self.probing()

    def _enough(self) -> float:
        """The open transactions a window must see to say something: SEEN_AT_LEAST over a
        window of samples, fewer when it was sampled less often."""
        return SEEN_AT_LEAST * len(self._sums) * SAMPLE / WINDOW

    def _close(self, window: int) -> None:
        mean = sum(self._sums) / len(self._sums)
        present = self._seen >= self._enough()
        if self.probing():
            if self._probed and present:
                self._quiet(sum(self._probed) / len(self._probed))
            return
        if present and all(group.rate == group.floor for group in self.groups):
            self._quiet(mean)  # held at the floor all window long: as good as a probe
        if present and self._dry and all(group.rate is None for group in self.groups):
            self._kept_up_at = window
            self.normal = _average(self.normal, mean, NORMAL)
        elif self._kept_up_at is not None and window - self._kept_up_at > NORMAL_KEPT:
            self.normal = None  # long ago: the probes say what is usual now
        self.signal = _average(self.signal, mean, SMOOTHING)
        for group in self.groups:
            change = group.judge(self.signal, self.baseline, kept_up=self._dry)
            if change:
                _said(group, change, self.signal, self.baseline)
        logger.debug(
            "yielding: open transactions %.2f ms (this window %.2f ms, %d seen%s), baseline %s "
            "ms, allowed %s jobs/s",
            self.signal * 1e3, mean * 1e3, self._seen, ", kept up" if self._dry else "",
            "?" if self.baseline is None else f"{self.baseline * 1e3:.2f}",
            ", ".join("-" if g.rate is None else f"{g.rate:.0f}" for g in self.groups),
        )  # fmt: skip

    def _quiet(self, value: float) -> None:
        self._probes = [*self._probes[-(PROBES_KEPT - 1) :], value]
        self.quiet = sorted(self._probes)[(len(self._probes) - 1) // 2]  # the lower median


def _average(average: float | None, value: float, weight: float) -> float:
    """An exponential average with `value` given `weight`; `value` itself when it is the first."""
    return value if average is None else weight * value + (1 - weight) * average


def _said(group: Yielding, change: str, signal: float, baseline: float | None) -> None:
    queues = ", ".join(group.queues)
    if change == "started":
        log_safely(
            logger.info,
            "yielding to the application (queues %s): its open transactions add up to %.1f ms, "
            "over %g × their baseline of %.1f ms; claiming at most %.0f jobs/s",
            queues, signal * 1000, group.budget, (baseline or 0) * 1000, group.rate or 0,
        )  # fmt: skip
    else:
        log_safely(logger.info, "no longer yielding to the application (queues %s)", queues)
