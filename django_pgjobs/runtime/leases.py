"""The lease keeper: a thread that renews the leases of a worker's running jobs every lease/3,
whatever the worker's main loop is doing (waiting, slow, or stuck on the database)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import DatabaseError, connections

from django_pgjobs.data.jobs import JobManager
from django_pgjobs.models import Job
from django_pgjobs.runtime.locks import LockWaits

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Heartbeats `claims()` (the worker's running jobs) on its own connection; `lease_of(job)`
    is each job's lease in seconds. A claim found lost is logged: its outcome will be refused."""

    def __init__(
        self,
        jobs: JobManager,
        claims: Callable[[], list[Job]],
        lease_of: Callable[[Job], float],
        default_lease: float,
        lock_waits: LockWaits,
    ) -> None:
        self.jobs, self.claims, self.lease_of = jobs, claims, lease_of
        self.default_lease = default_lease
        self.lock_waits = lock_waits
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="pgjobs-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def interval(self, claims: list[Job]) -> float:
        return min([self.default_lease, *map(self.lease_of, claims)]) / 3

    def renew(self, claims: list[Job]) -> None:
        """One round: extend every lease in `claims` that is not locked elsewhere."""
        by_lease: dict[float, list[Job]] = {}
        for job in claims:
            by_lease.setdefault(self.lease_of(job), []).append(job)
        for lease, jobs in by_lease.items():
            renewed = self.jobs.heartbeat(jobs, lease)
            skipped = [job for job in jobs if job.pk not in renewed]
            if skipped:  # locked elsewhere (renewed next time), or lost
                held = self.jobs.held(skipped)
                for job in skipped:
                    if job.pk not in held:
                        logger.warning(
                            "lost the lease of job %s (%s); its outcome will not be recorded",
                            job.pk, job.task,
                        )  # fmt: skip

    def _keep(self) -> None:
        try:
            self.lock_waits.limit_this_thread()
            while not self._stopped.wait(self.interval(self.claims())):
                claims = self.claims()
                if not claims:
                    continue
                try:
                    self.renew(claims)
                except DatabaseError as error:
                    # The next round tries again; a lease outlives two missed rounds.
                    logger.warning("could not renew leases: %s", str(error).strip())
                    connections[self.jobs.db].close()
        finally:
            connections.close_all()
