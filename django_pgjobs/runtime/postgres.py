"""Jobs from PostgreSQL: claimed with SKIP LOCKED and their outcomes recorded in one statement a
turn, leases renewed by a thread of their own, wake-ups by LISTEN, and the housekeeping of the
job table (reaping, promoting, pruning, periodic ticks).

A batch of outcomes the database refuses is recorded again job by job, so one bad outcome never
wedges the worker; outcomes whose rows another session holds locked are set aside (blocked), so
one locked row never stalls the others.

Where a worker's claims got to in each queue (Positions): its next claim starts there instead of
at the claim index's start. The index keeps an entry for every job claimed since the last vacuum,
and while a long snapshot keeps vacuum from removing them, a claim from the start reads them all.
A job that becomes ready behind a position is found by a sweep (a claim from the start), at least
every SWEEP_EVERY seconds and otherwise when the time since the last sweep is SWEEP_FACTOR times
what that sweep took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from django.db import DatabaseError, connections

from django_pgjobs.data import rows, sql, wakeups
from django_pgjobs.data.records import Claim, FailedAttempt, Failure, Keyed, Position, Settled
from django_pgjobs.data.wakeups import CHANNEL
from django_pgjobs.limits import TaskLimits
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome, Verdict
from django_pgjobs.registry import all_tasks
from django_pgjobs.runtime import execute, policy
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime.chores import Chore, Promoter, Pruner, Reaper, Scheduler, Sweeper
from django_pgjobs.runtime.leases import LeaseKeeper
from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.runtime.sessions import LockWaits, application_name
from django_pgjobs.runtime.sources import Exchange, Recorded, Seat

logger = logging.getLogger(__name__)

#: Seconds a queue where a claim found no limited jobs is left out of the claims of them (unless
#: a wake-up comes): jobs that come due without one (a retry's backoff, a lease taken back) wait
#: that much longer.
KEYLESS_FOR = 1.0
#: Claims in a row that find only keys at their limit, as many as one claim looks at, before a
#: worker leaves the queue's limited jobs for KEYLESS_FOR: 20 × 200 keys go round 4,000 keys.
PASS_AT_ONCE = 20
#: How long outcomes whose rows another session held locked wait before they are tried again
#: (each time only once their rows are free: they never make a turn wait for a lock again).
BLOCKED_RETRY = 1.0


class PostgresSource:
    """A worker's jobs from the job table."""

    queues_are = "queues"
    yields = True

    def __init__(self) -> None:
        self.chores: list[Chore] = []
        # Outcomes whose rows another session held locked, and when to try them again. The
        # lease keeper renews their claims, as it does every claim held.
        self._blocked: list[tuple[Job, Handled]] = []
        self._blocked_until = 0.0

    def attach(self, seat: Seat) -> None:
        self.seat, options = seat, seat.options
        self.db, self.id = seat.db, seat.id
        self.jobs = Job.objects.db_manager(seat.db)
        self.positions = Positions()
        # The limited tasks this worker runs, and where each queue's claims of their jobs got
        # to (the key after which the next claim starts).
        self.task_limits = TaskLimits.of(all_tasks())
        self.cursors: dict[str, tuple[str, str]] = {}
        self._round_up = False
        # Queues where a claim found no limited jobs, and until when (time.monotonic()) their
        # claims leave them out: a queue without any costs no statement a turn. A wake-up for
        # the queue ends it sooner (a limited job enqueued).
        self._keyless: dict[str, float] = {}
        # Claims in a row that passed over as many full keys as one may, by queue.
        self._passed: Counter[str] = Counter()
        # When a queue's limited jobs held back by a rate get their next start, by queue: due
        # jobs wait, so a --once worker is not drained (Exchange.held).
        self._next_start: dict[str, float] = {}
        self.lock_waits = LockWaits(seat.db, application_name(seat.id))
        self.leases = LeaseKeeper(
            self.jobs, seat.claims.all, self.lease_of, seat.lease, self.lock_waits
        )
        self.reaper = Reaper(self.jobs, options.reap_interval, seat.poll_now, seat.claims.all)
        self.sweeper = Sweeper(seat.db, options.reap_interval)
        self.chores = [self.reaper, Promoter(self.jobs, options.promote_interval), self.sweeper]
        if not options.once:
            ticks = Scheduler(seat.db, enqueued=seat.announcer.enqueued)
            self.chores += [Pruner(self.jobs, options.prune_interval), ticks]

    def lease_of(self, job: Job) -> float:
        return execute.limits_of(job, self.seat.lease)[0]

    def start(self) -> None:
        options = self.seat.options
        self.lock_waits.limit_this_thread(plans=True)
        if options.listen and not options.once:
            thread = threading.Thread(
                target=listen,
                args=(self.db, self._on_notify, self.seat.poll_now, self.seat.stopping),
                kwargs={"name": application_name(self.id)},
                name="pgjobs-listener",
                daemon=True,
            )
            thread.start()
        self.leases.start()

    def _on_notify(self, queue_name: str) -> None:
        if queue_name in self.seat.options.queues:
            self._keyless.pop(queue_name, None)
            self.seat.poll_now()

    def can_claim(self) -> bool:
        return not self.leases.behind()

    def renew(self, jobs: list[Job]) -> None:
        self.leases.renew([self._claim(job) for job in jobs])

    def give_back(self, jobs: list[Job]) -> None:
        self.jobs.release([self._claim(job) for job in jobs])

    def _claim(self, job: Job) -> Claim:
        """The claim the worker kept for `job` (the data layer names claims, not Jobs)."""
        return self.seat.claims.of(job)

    def due_in(self) -> float:
        return self._blocked_until - time.monotonic() if self._blocked else float("inf")

    def failed(self, error: Exception) -> None:
        self.reaper.trouble(error)

    def shutdown(self, left: list[Claim]) -> tuple[list[Recorded], bool]:
        self.leases.stop()
        clean = True
        if left:
            try:
                released = self.jobs.release(left)
                log_safely(
                    logger.warning,
                    "released %d unfinished jobs back to ready: %s",
                    len(released), ", ".join(str(pk) for pk in released),
                )  # fmt: skip
            except Exception as error:  # the database, or a bug: the process ends all the same
                clean = False
                log_safely(
                    logger.error,
                    "could not release %d jobs (%s); they return when their leases expire",
                    len(left), str(error).strip().splitlines()[0] if str(error).strip() else "",
                )  # fmt: skip
        return [], clean

    def close(self) -> None:
        self.lock_waits.stop()
        try:
            self.sweeper.follow_up_now()
        except DatabaseError as error:  # another worker's sweep will
            log_safely(logger.warning, "could not follow up batches at exit (%s)", error)

    # ---- a turn ------------------------------------------------------------------------------

    def exchange(
        self, finished: list[tuple[Job, Handled]], wanted: int, wait: float, turn: Exchange
    ) -> None:
        """Record the finished outcomes and claim into the free slots, in one statement; a
        Retry asked by a handler is recorded on its own, and so is each claim from a queue
        with a limit."""
        self.leases.renew_if_behind()  # the lease keeper's rounds fail: leases are renewed here
        began = time.monotonic()
        self._exchange(finished, wanted, turn)
        if time.monotonic() - began > policy.STALLED:
            self.reaper.stalled()
        if connections[self.db].connection is not None:
            self.reaper.calm()

    def _exchange(self, finished: list[tuple[Job, Handled]], wanted: int, turn: Exchange) -> None:
        seat, jobs = self.seat, self.jobs
        finished += self._unblocked()
        for item in [item for item in finished if item[1].verdict is Verdict.RETRY]:
            job, handled = item
            owned = jobs.retry_later(self._claim(job), handled.delay)
            finished.remove(item)
            turn.recorded.append(Recorded(job, handled, Outcome.RETRIED if owned else Outcome.LOST))
        succeeded = [item for item in finished if item[1].verdict is Verdict.SUCCEEDED]
        failed = [item for item in finished if item[1].verdict is Verdict.ERROR]
        if not (wanted or succeeded or failed):
            return
        limited: list[Job] = []
        wait = float("inf")
        if wanted:
            # Limited queues first, up to their share of the turn, so that a backlog in an
            # open queue cannot starve them; what they leave goes to the open queues. Then
            # the limited tasks' jobs in the open queues, in up to half of what is left.
            self._round_up = not self._round_up  # one slot goes to either, in turns
            wait = self._claim_limited(wanted - seat.controls.open_share(wanted), into=limited)
            # Whatever tasks this worker knows limits of: a task whose limits were dropped still
            # has jobs that only this claim takes.
            keyed = [queue for queue in seat.controls.open if self._may_hold_keyed(queue)]
            if keyed:
                left = wanted - len(limited)
                if share := (left + self._round_up) // 2:
                    wait = min(wait, self._claim_keyed(keyed, share, into=limited))
                else:
                    wait = time.monotonic()  # their turn is the next one
            # Queues left out this turn (looked at lately) whose next start is still to come.
            now, served = time.monotonic(), seat.controls.open
            wait = min(
                [wait, *(at for q, at in self._next_start.items() if q in served and at > now)]
            )
            turn.claimed += limited
        try:
            settled = self._record(succeeded, failed, wanted - len(limited))
        except DatabaseError as error:
            blocked = self._set_aside_blocked(error, [*succeeded, *failed])
            if not blocked:
                raise
            finished[:] = [item for item in finished if id(item[0]) not in blocked]
            succeeded = [item for item in succeeded if id(item[0]) not in blocked]
            failed = [item for item in failed if id(item[0]) not in blocked]
            settled = self._record(succeeded, failed, wanted - len(limited))
        finished.clear()  # every outcome is recorded now, or held
        for job, handled in [*succeeded, *failed]:
            status = settled.recorded.get(self._claim(job).key)
            turn.recorded.append(Recorded(job, handled, Outcome.of_status(status)))
        self._announce_free_slots([job for job, _ in [*succeeded, *failed]])
        turn.claimed += settled.claimed
        if wanted:
            turn.poll_by = min(self.positions.poll_by(len(turn.claimed), wanted), wait)
            turn.held = wait < float("inf")
        self.sweeper.ended(settled.batches)
        if wanted and not turn.claimed and self._follow_up():
            turn.poll_by = time.monotonic()  # callbacks enqueued, or jobs released: claim them
            turn.held = True
        if settled.unread is not None:  # the claims were given back; the outcomes are recorded
            raise settled.unread

    def _follow_up(self) -> int:
        """Follow up the batches ended so far, now that the worker is idle; returns how many
        batches and jobs moved. A failure is left to the sweeper's chore, which says why."""
        try:
            return self.sweeper.follow_up_now()
        except DatabaseError as error:
            if rows.connection_lost(error):
                raise
            self.sweeper.next_at = time.monotonic()
            return 0

    def _claim_limited(self, wanted: int, into: list[Job]) -> float:
        """Claim up to `wanted` jobs from the queues with a limit, into `into` (which keeps
        what was claimed if a later queue's claim fails); returns when (time.monotonic()) a
        limited task held back by its rate may start a job again. A queue whose controls'
        table is locked sits the turn out (the controls' own read says so)."""
        return self._claim_each(self.seat.controls.limited, wanted, into, lambda queue, room: (
            self.jobs.claim_limited(
                queue, worker=self.id, limit=room, lease=self.seat.lease,
                limits=self.task_limits if self._may_hold_keyed(queue) else None,
                after=self.cursors.get(queue, ("", "")), round_up=self._round_up,
            )
        ))  # fmt: skip

    def _claim_keyed(self, queues: list[str], wanted: int, into: list[Job]) -> float:
        """Claim up to `wanted` jobs of limited tasks from `queues` (open ones), into `into`;
        returns as _claim_limited does. A queue whose bucket or key rows are locked sits the
        turn out, and every other claim goes on."""
        return self._claim_each(queues, wanted, into, lambda queue, room: (
            self.jobs.claim_keyed(
                queue, self.task_limits, worker=self.id, limit=room, lease=self.seat.lease,
                after=self.cursors.get(queue, ("", "")),
            )
        ))  # fmt: skip

    def _claim_each(
        self, queues: list[str], wanted: int, into: list[Job],
        claim: Callable[[str, int], Keyed],
    ) -> float:  # fmt: skip
        """`claim(queue, room)` in each of `queues` until `wanted` jobs are in `into`; returns
        the soonest time a queue's limited jobs held back by a rate may start."""
        start, rooms = len(into), self.seat.controls.rooms
        wait = float("inf")
        for queue_name in queues:
            room = min(wanted - (len(into) - start), rooms.get(queue_name, wanted))
            if room <= 0:
                continue
            try:
                keyed = claim(queue_name, room)
            except DatabaseError as error:
                if not rows.timed_out(error):
                    raise
                continue  # a lock held elsewhere: this queue sits the turn out
            into += keyed.claimed
            wait = min(wait, self._next_keyed_claim(queue_name, keyed))
        return wait

    def _announce_free_slots(self, ended: list[Job]) -> None:
        """Wake the workers of the queues where an ended job of a concurrency-limited task
        freed a slot (this worker looks again at once: runtime/worker.py)."""
        counted = self.task_limits.counted
        freed = {job.queue for job in ended if job.limit_key is not None and job.task in counted}
        if freed and (queues := wakeups.to_send(self.db, sorted(freed))):
            rows.execute(self.db, sql.WAKE_UP, {"channel": CHANNEL, "queues": queues})

    def _may_hold_keyed(self, queue_name: str) -> bool:
        """Whether `queue_name` may hold due limited jobs: no claim found none there lately."""
        return time.monotonic() >= self._keyless.get(queue_name, 0.0)

    def _next_keyed_claim(self, queue_name: str, keyed: Keyed) -> float:
        """Keep where a claim of limited tasks' jobs got to; returns when to claim again for
        those its limits held back."""
        self.cursors[queue_name] = keyed.cursor
        now = time.monotonic()
        if keyed.keys == 0 and keyed.more and self._passed[queue_name] < PASS_AT_ONCE:
            self._passed[queue_name] += 1  # every key it looked at was full: on to the next
            return now
        self._passed[queue_name] = 0
        start = float("inf") if keyed.wait is None else now + max(0.0, keyed.wait)
        if keyed.keys == 0:
            # None with room: looked at again after a while, at the next start a rate gives,
            # or when a slot frees (a wake-up).
            self._keyless[queue_name] = min(now + KEYLESS_FOR, start)
        if start < float("inf"):
            self._next_start[queue_name] = start
        else:
            self._next_start.pop(queue_name, None)
        return start

    def _unblocked(self) -> list[tuple[Job, Handled]]:
        """The blocked outcomes due to be tried again whose rows are free now (the others stay
        blocked); none before their time, unless the worker is stopping."""
        if not self._blocked or (
            time.monotonic() < self._blocked_until and not self.seat.stopping()
        ):
            return []
        locked = self.jobs.locked_elsewhere([self._claim(job) for job, _ in self._blocked])
        free = [item for item in self._blocked if self._claim(item[0]).id not in locked]
        self._blocked = [item for item in self._blocked if self._claim(item[0]).id in locked]
        self._blocked_until = time.monotonic() + BLOCKED_RETRY
        return free

    def _set_aside_blocked(
        self, error: DatabaseError, outcomes: list[tuple[Job, Handled]]
    ) -> set[int]:
        """After the turn's statement ran out of time (its lock_timeout, or a shorter
        statement_timeout of the project's): set aside the outcomes whose rows another session
        holds locked, to be recorded once they are free. Returns them (as id(job)); none when
        `error` is not such a wait or no row is locked."""
        if not (outcomes and rows.timed_out(error)):
            return set()
        locked = self.jobs.locked_elsewhere([self._claim(job) for job, _ in outcomes])
        blocked = [item for item in outcomes if self._claim(item[0]).id in locked]
        if blocked:
            self._blocked += blocked
            self._blocked_until = time.monotonic() + BLOCKED_RETRY
            log_safely(
                logger.warning,
                "the rows of %d finished jobs are locked by another session (%s); recording "
                "the other outcomes, and those once their rows are free",
                len(blocked), ", ".join(str(job.pk) for job, _ in blocked),
            )  # fmt: skip
        return {id(job) for job, _ in blocked}

    def _record(
        self,
        succeeded: list[tuple[Job, Handled]],
        failed: list[tuple[Job, Handled]],
        limit: int,
    ) -> Settled:
        """Record the outcomes and claim up to `limit` jobs from the open queues."""
        try:
            started = time.monotonic()
            done = [(self._claim(job), handled) for job, handled in succeeded]
            settled: Settled = self.jobs.settle_and_claim(
                [claim for claim, _ in done],
                [_attempt(self._claim(job), handled) for job, handled in failed],
                self.seat.controls.open,
                worker=self.id,
                limit=limit,
                lease=self.seat.lease,
                results=_results(done),
                after=self.positions.for_turn() if limit > 0 else None,
                rooms=self.seat.controls.rooms,
                follow_batches=False,  # the sweeper does, once for several turns
            )
            if limit > 0:
                self.positions.turned(settled.claimed, time.monotonic() - started)
                rows.replan(self.db, backlog=len(settled.claimed) == limit)
            return settled
        except DatabaseError as error:
            if rows.connection_lost(error):
                raise  # the connection: tried again after the reconnect
            if not (succeeded or failed):
                raise  # only a claim: nothing of a job's to blame (e.g. a missing table)
            log_safely(
                logger.error,
                "the database refused a turn's %d outcomes (%s); recording them one by one",
                len(succeeded) + len(failed), str(error).strip().splitlines()[0],
            )  # fmt: skip
            self.seat.poll_now()  # the claim is taken again at the next turn
            return self._one_by_one(succeeded, failed)

    def _one_by_one(
        self, succeeded: list[tuple[Job, Handled]], failed: list[tuple[Job, Handled]]
    ) -> Settled:
        """Record each outcome in its own statement; one the database refuses again is
        recorded as a permanent failure saying why (a dead letter, never retried forever)."""
        jobs, worker = self.jobs, self.id
        result = Settled(set(), {}, [], {})
        for job, handled in [*succeeded, *failed]:
            claim = self._claim(job)
            one = [claim] if handled.verdict is Verdict.SUCCEEDED else []
            attempt = [] if one else [_attempt(claim, handled)]
            try:
                settled = jobs.settle_and_claim(
                    one, attempt, [], worker=worker, limit=0, results=_results([(claim, handled)])
                )
            except DatabaseError as error:
                if rows.connection_lost(error):
                    raise
                job.progress = None  # nothing of the refused outcome's may be refused again
                refused = Failure(
                    "django_pgjobs.OutcomeRefused",
                    f"the database refused to record this attempt's outcome "
                    f"({handled.verdict.value}): {str(error).strip()}",
                )
                status = jobs.fail(claim, refused, permanent=True, delay=0)
                recorded = {claim.key: status} if status else {}
                settled = Settled(set(), {}, [], recorded)
                log_safely(logger.error, "job %s (%s): %s", job.pk, job.task, refused.message)
            result.recorded.update(settled.recorded)
        return result


def _attempt(claim: Claim, handled: Handled) -> FailedAttempt:
    assert handled.failure is not None
    return FailedAttempt(claim, handled.failure, handled.permanent, handled.delay)


def _results(succeeded: list[tuple[Claim, Handled]]) -> dict[UUID, str]:
    return {
        claim.id: handled.result_json
        for claim, handled in succeeded
        if handled.verdict is Verdict.SUCCEEDED and handled.result_json is not None
    }


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


def listen(
    db: str, on_notify: Callable[[str], None], on_connect: Callable[[], None],
    stopping: Callable[[], bool], name: str = "",
) -> None:  # fmt: skip
    """LISTEN on a dedicated connection (its application_name `name`, when given and the
    database's OPTIONS name none) until
    `stopping()`; reconnect with backoff on errors, whatever they are.

    Calls on_notify(queue) for each notification and on_connect() after every (re)connect, so
    the worker polls at once for whatever it missed while disconnected.
    """
    locks.unpooled(db)  # a connection of its own, not one of a Django pool's
    wrapper = connections[db]
    failures = 0
    while not stopping():
        try:
            params = wrapper.get_connection_params()
            if name and not params.get("application_name"):  # a name from OPTIONS is kept
                params["application_name"] = name
            connection: Any = wrapper.get_new_connection(params)
            try:
                connection.autocommit = True
                # Frozen, this process would hold back the server's notification queue; idle, it
                # is by design (runtime/sessions.py).
                if not locks.pooled(db):
                    connection.execute(
                        "SELECT set_config('tcp_user_timeout', %s, false), "
                        "set_config('idle_session_timeout', %s, false)",
                        [locks.user_timeout(db), locks.IDLE_SESSION],
                    )
                connection.execute(f"LISTEN {CHANNEL}")
                on_connect()
                failures = 0
                while not stopping():
                    for notification in connection.notifies(timeout=0.5):
                        on_notify(notification.payload)
            finally:
                connection.close()
        # BaseException: this thread ends only when the worker stops; nothing else tells the
        # worker that wake-ups stopped coming (it would fall back to polling, unnoticed).
        except BaseException as error:
            failures += 1
            delay = policy.doubling(0.2, failures, 5.0)
            log_safely(
                logger.warning,
                "wake-up listener lost its connection (%s: %s); retrying in %.1fs",
                type(error).__name__, error, delay,
            )  # fmt: skip
            time.sleep(delay)
