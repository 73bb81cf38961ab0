"""The lease keeper: a thread that renews the leases of a worker's running jobs every lease/3,
and writes their handlers' progress reports about once a second, whatever the worker's main
loop is doing (waiting, slow, or stuck on the database). It lives as long as the worker: a
round that fails, whatever it raised, is tried again after a pause, and a logging filter of
the application's that raises cannot end it (runtime/reporting.py, `log_safely`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from uuid import UUID

from django.db import DatabaseError, connections

from django_pgjobs.data import rows
from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.records import Claim, ClaimKey, as_claim
from django_pgjobs.models import Job
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.runtime.sessions import LockWaits

logger = logging.getLogger(__name__)

#: How often the lease keeper looks for progress reports to write: a job's report is written
#: at most this often (and with every heartbeat), however often its handler reports.
PROGRESS_INTERVAL = 1.0

#: After a failed round the keeper waits this long before the next, twice as long after each
#: further failure, up to lease/6 and RETRY_PAUSE_MAX: at least two more tries still fit inside
#: the shortest lease, a database that refuses (a failover's read-only primary, a bad password)
#: is not hammered with a reconnect for every try, and once the trouble is over every live
#: keeper renews its leases within policy.REAP_RECOVERY, before any worker takes them back.
RETRY_PAUSE = 0.5
RETRY_PAUSE_MAX = 5.0

#: While its rounds keep failing, the keeper says so at most this often (and when they work
#: again), not at every try.
FAILURE_LOG_INTERVAL = 30.0


class LeaseKeeper:
    """Heartbeats `claims()` (the worker's running jobs) on its own connection; `lease_of(job)`
    is each job's lease in seconds. Between heartbeats it writes, about once a second, the
    claims whose handlers reported progress since their last write. A claim found lost is
    logged once and left alone from then on: its outcome will be refused.

    A claim is found lost when two rounds in a row (about a second apart) find it no longer
    held and still among `claims()`: one round is not enough, because the worker's main thread
    may have recorded the job's outcome between this thread's reading of `claims()` and its
    heartbeat, and forgets the claim only once that statement has returned."""

    def __init__(
        self,
        jobs: JobManager,
        claims: Callable[[], Sequence[Claim | Job]],
        lease_of: Callable[[Job], float],
        default_lease: float,
        lock_waits: LockWaits,
    ) -> None:
        self.jobs, self.claims, self.lease_of = jobs, claims, lease_of
        self.default_lease = default_lease
        self.lock_waits = lock_waits
        # By claim, never by job id (a stale and a fresh claim of one job may both be here):
        # the report last written of each, the claims found lost, and those whose rows were
        # locked elsewhere at their last heartbeat (tried again every round until renewed).
        self._written: dict[ClaimKey, object] = {}
        self._lost: set[ClaimKey] = set()
        self._locked: set[ClaimKey] = set()
        self._unheld: set[ClaimKey] = set()  # found not held once: lost if so again next round
        self._interval = default_lease / 3  # between heartbeats, as of the last round
        self._renewed_at = time.monotonic()  # the last heartbeat that went through
        self._standing_in = False  # whether the main thread renews the leases meanwhile
        self._rounds = threading.Lock()  # one round at a time: this thread's or a stand-in's
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="pgjobs-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def interval(self, claims: list[Claim]) -> float:
        return min([self.default_lease, *(self.lease_of(c.job) for c in claims)]) / 3

    def behind(self) -> bool:
        """Whether no heartbeat went through for half an interval past the one that was due:
        this thread's rounds fail (its connection refused, say, when the database has no
        connection left for it) or it is held up. Claims made now would be lost."""
        return time.monotonic() - self._renewed_at > 1.5 * self._interval

    def renew_if_behind(self) -> None:
        """On the worker's main thread, while overdue: heartbeat the running claims on that
        thread's connection, unless this thread is in the middle of a round. A lost connection
        is the caller's to handle; any other failure leaves the leases overdue (the worker then
        claims nothing), and this thread's own log lines say why."""
        if not self.behind() or not self._rounds.acquire(blocking=False):
            return
        try:
            if not self._standing_in:
                self._standing_in = True
                log_safely(
                    logger.warning,
                    "the lease keeper has renewed no lease for %.0fs; the worker's main loop "
                    "renews them, and claims nothing more while it cannot",
                    time.monotonic() - self._renewed_at,
                )  # fmt: skip
            claims = [as_claim(claim) for claim in self.claims()]
            if claims:
                self.keep_up(claims, heartbeat=True)
            self._renewed_at = time.monotonic()
        except Exception as error:
            if isinstance(error, DatabaseError) and rows.connection_lost(error):
                raise
        finally:
            self._rounds.release()

    def renew(self, claims: Sequence[Claim | Job]) -> set[UUID]:
        """Extend every lease in `claims` that is not locked elsewhere, writing each one's
        latest progress report; returns the ids renewed."""
        by_lease: dict[float, list[Claim]] = {}
        for claim in map(as_claim, claims):
            by_lease.setdefault(self.lease_of(claim.job), []).append(claim)
        renewed: set[UUID] = set()
        for lease, group in by_lease.items():
            renewed |= self.jobs.heartbeat(group, lease)
            skipped = [claim for claim in group if claim.id not in renewed]
            if skipped:  # locked elsewhere (renewed next round), settled meanwhile, or lost
                owned = self.jobs.owned(skipped)
                for claim in skipped:
                    if claim.id in owned:
                        self._locked.add(claim.key)
                    elif claim.key not in self._unheld:
                        self._unheld.add(claim.key)  # looked at again next round
                    else:
                        self._lost.add(claim.key)
                        log_safely(
                            logger.warning,
                            "lost the lease of job %s (%s); its outcome will not be recorded",
                            claim.id, claim.job.task,
                        )  # fmt: skip
        return renewed

    def keep_up(self, claims: Sequence[Claim | Job], heartbeat: bool) -> None:
        """One round over `claims`: all of them when a heartbeat is due, else only those whose
        handlers reported progress since their last write (none: no statement at all)."""
        held = [as_claim(claim) for claim in claims]
        live = [claim for claim in held if claim.key not in self._lost]
        # Read once: a handler may report again while its report is being written.
        reports = {claim.key: claim.job.progress for claim in live}
        # A row that was locked at the last heartbeat is tried every round, not only at the
        # next heartbeat: its lease must be renewed as soon as the lock is gone, before the
        # reaper (which skips locked rows too) can find the lease expired.
        due = [
            claim
            for claim in live
            if heartbeat
            or claim.key in self._locked
            or claim.key in self._unheld
            or reports[claim.key] is not self._written.get(claim.key)
        ]
        if due:
            renewed = self.renew(due)
            for claim in due:
                if claim.id in renewed:
                    self._written[claim.key] = reports[claim.key]
                    self._locked.discard(claim.key)
        # Forget the claims that ended.
        self._written = {
            claim: report for claim, report in self._written.items() if claim in reports
        }
        current = {claim.key for claim in held}
        self._lost &= current
        self._locked &= current
        self._unheld &= current

    def retry_pause(self, failures: int) -> float:
        """How long to wait for the next round after `failures` failed rounds in a row."""
        return policy.doubling(RETRY_PAUSE, failures, min(self._interval / 2, RETRY_PAUSE_MAX))

    def _keep(self) -> None:
        try:
            self.lock_waits.limit_this_thread()
            heartbeat_at = time.monotonic() + self.default_lease / 3
            retry_at = 0.0  # no round before this, after a failed one
            failures = 0  # rounds failed in a row
            logged_at = 0.0  # when the failures were last logged
            while True:
                wait = min(PROGRESS_INTERVAL, heartbeat_at - time.monotonic())
                wait = max(wait, retry_at - time.monotonic())
                if self._stopped.wait(max(0.0, wait)):
                    return
                try:
                    heartbeat_at = self._round(heartbeat_at)
                # BaseException: whatever a round raised (a bug, a lease_of that raised, even
                # SystemExit), this thread must live on: if it ended, every lease of this worker
                # would run out under its handlers. A failed heartbeat stays due (heartbeat_at is
                # unchanged): the next round, after the pause, is one.
                except BaseException as error:
                    failures += 1
                    retry_at = time.monotonic() + self.retry_pause(failures)
                    if isinstance(error, DatabaseError):  # the next round connects anew
                        with contextlib.suppress(BaseException):  # unusable either way
                            connections[self.jobs.db].close()
                    if failures == 1 or time.monotonic() - logged_at >= FAILURE_LOG_INTERVAL:
                        logged_at = time.monotonic()
                        log_safely(self._log_failure, error, failures)
                else:
                    if failures:
                        log_safely(
                            logger.info,
                            "the lease keeper renews leases again, after %d failed rounds",
                            failures,
                        )
                    failures = 0
        finally:
            connections.close_all()

    def _log_failure(self, error: BaseException, failures: int) -> None:
        """The first failure with its cause (with a traceback, unless the database refused),
        then how many rounds failed, now and then."""
        pause = self.retry_pause(failures)
        if failures > 1:
            logger.warning(
                "the lease keeper's last %d rounds failed (%s: %s); trying again every %.1fs",
                failures, type(error).__name__, str(error).strip(), pause,
            )  # fmt: skip
        elif isinstance(error, DatabaseError):
            logger.warning(
                "could not renew leases: %s; trying again in %.1fs", str(error).strip(), pause
            )
        else:
            logger.error(
                "the lease keeper's round failed; trying again in %.1fs", pause, exc_info=error
            )

    def _round(self, heartbeat_at: float) -> float:
        """One round: a heartbeat if it is due (else only new progress reports); returns when
        the next heartbeat is due."""
        with self._rounds:
            claims = [as_claim(claim) for claim in self.claims()]
            self._interval = self.interval(claims)
            # A claim with a shorter lease may have come since the last heartbeat.
            heartbeat_at = min(heartbeat_at, time.monotonic() + self._interval)
            heartbeat = time.monotonic() >= heartbeat_at
            if heartbeat:
                heartbeat_at = time.monotonic() + self._interval
            if claims:
                self.keep_up(claims, heartbeat)
            if heartbeat or not claims:
                self._renewed_at = time.monotonic()
                self._standing_in = False
            return heartbeat_at
