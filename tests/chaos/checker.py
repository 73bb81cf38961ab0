"""The chaos suite's instruments: the driver that records every enqueue, the audit trigger that
records every write to a running job, and the checker that judges a run from the outside.

What the checker reports (the contract is SQS's: at-least-once, duplicates only after a fault):

- lost: accepted jobs (and any job in the table) not in a final state after the drain;
- stuck: running jobs whose lease expired longer ago than the reap interval plus slack, sampled
  all through the run (the largest count seen);
- unexpected executions: ledger rows of a job nobody enqueued, or of an attempt nobody claimed;
- stale writes: a heartbeat or finishing write accepted from a process other than the one that
  holds the claim, or a success recorded for an attempt whose handler had not finished;
- duplicates: jobs whose handler ran to the end more than once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from django.db import DatabaseError, connections, transaction

from django_pgjobs.models import Job

#: How often each worker reaps (worker.Options.reap_interval) and how long past that an expired
#: lease may go unreaped before the job counts as stuck (reconnect backoff, a restart, a busy box).
REAP_INTERVAL = 5.0
STUCK_SLACK = 10.0

FINAL = ("succeeded", "failed", "cancelled")

AUDIT_SQL = """
CREATE OR REPLACE FUNCTION chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_transition (job_id, kind, old_status, new_status, old_worker, new_worker,
                                  old_attempts, new_attempts, issuer, at)
    VALUES (NEW.id,
            CASE
                WHEN OLD.status <> 'running' THEN 'claim'
                WHEN NEW.status = 'running' AND NEW.worker IS NOT DISTINCT FROM OLD.worker
                     AND NEW.attempts = OLD.attempts THEN 'heartbeat'
                WHEN NEW.status = 'running' THEN 'other'
                WHEN OLD.leased_until < statement_timestamp()
                     AND NEW.errors -> -1 ->> 'type' = 'WorkerLost'
                     AND NEW.errors IS DISTINCT FROM OLD.errors THEN 'reap'
                ELSE 'finish'
            END,
            OLD.status, NEW.status, OLD.worker, NEW.worker, OLD.attempts, NEW.attempts,
            current_setting('application_name'), clock_timestamp());
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS chaos_audit ON pgjobs_job;
CREATE TRIGGER chaos_audit AFTER UPDATE ON pgjobs_job FOR EACH ROW
    WHEN (OLD.status = 'running' OR NEW.status = 'running') EXECUTE FUNCTION chaos_audit();
"""
REMOVE_AUDIT_SQL = "DROP TRIGGER IF EXISTS chaos_audit ON pgjobs_job"

# The pid a worker id (host:pid:suffix) or an issuer (chaos:pid) names.
_PID = "split_part({}, ':', -{})"
_OWNER_PID = _PID.format("t.old_worker", 2)
_ISSUER_PID = _PID.format("t.issuer", 1)

STALE_WRITES_SQL = f"""
SELECT count(*) FROM chaos_transition t
WHERE (t.kind IN ('heartbeat', 'finish') AND (t.issuer NOT LIKE 'chaos:%'
                                             OR {_ISSUER_PID} <> {_OWNER_PID}))
   OR (t.kind = 'claim' AND (t.issuer NOT LIKE 'chaos:%'
                             OR {_ISSUER_PID} <> {_PID.format("t.new_worker", 2)}))
   OR t.kind = 'other'
   OR (t.kind = 'finish' AND t.new_status = 'succeeded'
       AND EXISTS (SELECT 1 FROM pgjobs_job j WHERE j.id = t.job_id AND j.task LIKE 'chaos.%')
       AND NOT EXISTS (
           SELECT 1 FROM chaos_execution e
           WHERE e.job_id = t.job_id AND e.attempt = t.old_attempts AND e.worker = t.old_worker
             AND e.ok AND e.at <= t.at))
"""

UNEXPECTED_SQL = """
SELECT count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM pgjobs_job j WHERE j.id = e.job_id)),
       count(*) FILTER (WHERE EXISTS (SELECT 1 FROM pgjobs_job j WHERE j.id = e.job_id)
                          AND NOT EXISTS (SELECT 1 FROM chaos_transition t
                                          WHERE t.job_id = e.job_id AND t.kind = 'claim'
                                            AND t.new_attempts = e.attempt
                                            AND t.new_worker = e.worker))
FROM chaos_execution e
"""

# Jobs whose handler ran to the end more than once, and the pids of the runs that did not
# become the recorded outcome (the ones a fault must explain).
DUPLICATES_SQL = """
SELECT e.job_id, array_agg(e.pid) FILTER (WHERE (e.attempt, e.worker) <> (j.attempts, j.worker))
FROM chaos_execution e JOIN pgjobs_job j ON j.id = e.job_id
WHERE e.ok
GROUP BY e.job_id HAVING count(*) > 1
"""

STUCK_SQL = """
SELECT count(*) FROM pgjobs_job
WHERE status = 'running'
  AND leased_until < statement_timestamp() - make_interval(secs => %s)
"""


@dataclass
class Report:
    """One scenario's figures, as printed at the end of the run and quoted in the docs."""

    scenario: str
    jobs: int = 0
    in_doubt: int = 0
    executions: int = 0
    faults: int = 0
    lost: int = 0
    stuck: int = 0
    unexpected: int = 0
    stale_writes: int = 0
    duplicates: int = 0
    duplicate_allowance: int = 0
    unexplained_duplicates: int = 0
    wall_seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"{self.scenario}: jobs={self.jobs} faults={self.faults} lost={self.lost} "
            f"stuck={self.stuck} unexpected={self.unexpected} stale_writes={self.stale_writes} "
            f"duplicates={self.duplicates} (allowed {self.duplicate_allowance}) "
            f"executions={self.executions} wall={self.wall_seconds:.1f}s"
            + (f" {json.dumps(self.details)}" if self.details else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Driver:
    """Enqueues through the public API and records what was accepted.

    Every payload carries a sequence number `n`. A batch whose transaction committed is
    accepted; one that failed with a database error may or may not have committed (the
    acknowledgement can be lost in a restart), so its numbers are in doubt: those jobs may run,
    and if they exist they must finish like any other.
    """

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self.accepted: dict[UUID, int] = {}
        self.in_doubt: set[int] = set()
        self.refused = 0
        self._next = 0

    def enqueue(self, task: str, count: int, **payload: Any) -> int:
        """Enqueue `count` jobs in one transaction; returns how many were accepted."""
        numbers = range(self._next, self._next + count)
        self._next += count
        try:
            with transaction.atomic(using=self.alias):
                jobs = Job.objects.db_manager(self.alias).bulk_enqueue(
                    task, ({"n": n, **payload} for n in numbers)
                )
        except DatabaseError:
            connections[self.alias].close()
            self.in_doubt.update(numbers)
            self.refused += count
            return 0
        for job in jobs:
            self.accepted[job.pk] = job.payload["n"]
        return len(jobs)

    def feeder(self, task: str, total: int, per_call: int, **payload: Any) -> Callable[[], bool]:
        """A `feed` for drive(): each call enqueues up to `per_call` more jobs until `total` are
        accepted; returns whether more are to come."""

        def feed() -> bool:
            left = total - len(self.accepted)
            if left > 0:
                self.enqueue(task, min(per_call, left), **payload)
            return len(self.accepted) < total

        return feed

    def accept(self, ids: Iterable[UUID]) -> None:
        """Record jobs written some other way (raw SQL)."""
        for job_id in ids:
            self.accepted[job_id] = -1


class Checker:
    """Judges a run from the database: installs the audit trigger, samples stuck jobs while
    the run goes on, and computes the report at the end."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], scenario: str) -> None:
        self._connect = connect
        self._connection: psycopg.Connection[Any] | None = None
        self.report = Report(scenario)
        self.started = time.monotonic()
        self.stuck_threshold = REAP_INTERVAL + STUCK_SLACK

    def install(self) -> None:
        self._query(AUDIT_SQL)

    def remove(self) -> None:
        self._query(REMOVE_AUDIT_SQL)
        if self._connection is not None:
            self._connection.close()

    def _query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        if self._connection is None or self._connection.closed:
            self._connection = self._connect()
        try:
            cursor = self._connection.execute(sql, params)
            return cursor.fetchall() if cursor.description else []
        except psycopg.OperationalError:
            self._connection.close()
            raise

    def sample(self) -> None:
        """Count stuck jobs now; the largest count seen is reported. Quiet while the database
        is away (that is the fault under test)."""
        try:
            ((stuck,),) = self._query(STUCK_SQL, [self.stuck_threshold])
        except psycopg.OperationalError:
            return
        self.report.stuck = max(self.report.stuck, stuck)

    def unfinished(self) -> int | None:
        """Jobs not yet final, or None while the database cannot be reached."""
        try:
            ((count,),) = self._query(
                "SELECT count(*) FROM pgjobs_job WHERE status IN ('ready', 'running')"
            )
        except psycopg.OperationalError:
            return None
        return int(count)

    def statuses(self) -> dict[str, int]:
        return dict(self._query("SELECT status, count(*) FROM pgjobs_job GROUP BY status"))

    def check(
        self,
        driver: Driver,
        *,
        faults: int = 0,
        allowance: int = 0,
        faulted_pids: set[int] | None = None,
        crashes: bool = False,
    ) -> Report:
        """The figures after the drain. `allowance` is how many duplicates the injected faults can
        explain; with `faulted_pids`, every superseded run of a duplicate must come from one of
        those processes. `crashes`: the faults include crashes of PostgreSQL, which may undo the
        worker's last commits (asynchronous, see guarantees.md), a claim among them: a run under
        a claim the database no longer has is then a duplicate the crash caused (bounded by the
        allowance like the others), not an unexpected one."""
        report = self.report
        self.sample()
        rows = self._query("SELECT id, status, payload ->> 'n' FROM pgjobs_job")
        in_table = {job_id: (status, n) for job_id, status, n in rows}
        accepted = set(driver.accepted)
        # An in-doubt job that exists did commit: it was accepted after all.
        accepted |= {
            job_id
            for job_id, (_, n) in in_table.items()
            if n is not None and n.lstrip("-").isdigit() and int(n) in driver.in_doubt
        }
        strangers = set(in_table) - accepted
        report.jobs = len(accepted)
        report.in_doubt = len(driver.in_doubt)
        report.lost = sum(
            1 for job_id in accepted if in_table.get(job_id, ("missing",))[0] not in FINAL
        ) + sum(1 for job_id in strangers if in_table[job_id][0] not in FINAL)
        ((report.executions,),) = self._query("SELECT count(*) FROM chaos_execution")
        ((unexpected, unclaimed),) = self._query(UNEXPECTED_SQL)
        report.details["runs_under_undone_claims"] = int(unclaimed)
        if not crashes:
            unexpected += unclaimed
        stranger_runs = 0
        if strangers:
            ((stranger_runs,),) = self._query(
                "SELECT count(*) FROM chaos_execution WHERE job_id = ANY(%s)", [list(strangers)]
            )
        report.unexpected = int(unexpected) + int(stranger_runs)
        ((report.stale_writes,),) = self._query(STALE_WRITES_SQL)
        duplicates = self._query(DUPLICATES_SQL)
        report.duplicates = len(duplicates)
        report.faults = faults
        report.duplicate_allowance = allowance
        if faulted_pids is not None:
            report.unexplained_duplicates = sum(
                1 for _, pids in duplicates if not set(pids or []) <= faulted_pids
            )
        report.details["writes"] = dict(
            self._query("SELECT kind, count(*) FROM chaos_transition GROUP BY kind ORDER BY kind")
        )
        report.wall_seconds = round(time.monotonic() - self.started, 1)
        return report

    def assert_sound(self, report: Report) -> None:
        """The thresholds every scenario holds to."""
        assert report.lost == 0, report.line()
        assert report.stuck == 0, report.line()
        assert report.unexpected == 0, report.line()
        assert report.stale_writes == 0, report.line()
        assert report.duplicates <= report.duplicate_allowance, report.line()
        assert report.unexplained_duplicates == 0, report.line()


def drive(
    checker: Checker,
    *,
    timeout: float,
    feed: Callable[[], bool] | None = None,
    fault: Callable[[], int] | None = None,
    fault_every: float = 1.0,
    tick: float = 0.1,
) -> int:
    """Run until every job is final: call `feed` each tick until it returns False (no more to
    enqueue), inject `fault` every `fault_every` seconds while jobs remain (it returns how many
    faults it caused), sample stuck jobs. Returns the number of faults; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    next_fault = time.monotonic() + fault_every
    feeding = feed is not None
    faults = 0
    while True:
        if feeding and feed is not None:
            feeding = feed()
        checker.sample()
        unfinished = checker.unfinished()
        if not feeding and unfinished == 0:
            return faults
        now = time.monotonic()
        if fault is not None and now >= next_fault:
            faults += fault()
            next_fault = now + fault_every
        if now > deadline:
            raise AssertionError(
                f"{checker.report.scenario}: jobs still unfinished after {timeout}s: "
                f"{checker.statuses()}"
            )
        time.sleep(tick)
