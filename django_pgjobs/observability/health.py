"""The health verdict: the report's figures judged against thresholds (PGJOBS["HEALTH"]).

Each reason names the threshold it used and the documentation section that explains what to
do. Levels follow the monitoring-plugin convention (0 healthy to 3 unknown): `jobstats` is a probe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import IntEnum

from django_pgjobs.conf import get_settings
from django_pgjobs.observability import figures
from django_pgjobs.observability.dbstats import TableLock
from django_pgjobs.observability.figures import Figures
from django_pgjobs.observability.stats import StreamStats, served_queues

#: Where the reasons are explained.
DOC = "docs/howto/monitoring.md"


@dataclass(frozen=True)
class Thresholds:
    """The verdict's thresholds; override any of them in PGJOBS["HEALTH"]."""

    #: A due job waiting this long means the workers are behind.
    OLDEST_DUE_SECONDS: float = 300.0
    #: Due jobs this old in a queue no live worker serves: critical.
    UNSERVED_SECONDS: float = 60.0
    #: A transaction (or prepared transaction) this old holds vacuum back.
    SNAPSHOT_SECONDS: float = 300.0
    #: Dead tuples at least this many and this share of the live ones: autovacuum lags.
    DEAD_TUPLES: float = 100_000
    DEAD_RATIO: float = 0.2
    #: Over 5 minutes, at least this share of a queue's attempts retried...
    RETRY_RATE: float = 0.5
    #: ...out of at least this many attempts: a retry storm.
    RETRY_MIN_ATTEMPTS: float = 100
    #: Client connections over this share of max_connections.
    CONNECTIONS_RATIO: float = 0.8
    #: pg_notification_queue_usage() over this.
    NOTIFY_QUEUE_USAGE: float = 0.5
    #: Jobs finished per second over 15 minutes beyond which strain means graduating.
    ENVELOPE_JOBS_PER_SECOND: float = 1000.0
    #: A NATS queue's oldest due job still in the outbox this long: the relay is behind.
    RELAY_LAG_SECONDS: float = 30.0
    #: A NATS queue's consumer with this many messages not yet delivered: workers are behind.
    NATS_PENDING: float = 10_000
    #: The queue's share of the database's active time over this.
    QUEUE_SHARE: float = 0.5
    #: Not thresholds: the report's time limits (figures.py).
    REPORT_LOCK_SECONDS: float = figures.REPORT_LOCK_SECONDS
    REPORT_STATEMENT_SECONDS: float = figures.REPORT_STATEMENT_SECONDS


#: The workers' lock_timeout: a lock on the job table held or queued this long fails their writes.
LOCKED_SECONDS = 5.0

THRESHOLD_NAMES = frozenset(field.name for field in fields(Thresholds))


def thresholds() -> Thresholds:
    """PGJOBS["HEALTH"] over the defaults (unknown keys are reported by check pgjobs.W020)."""
    overrides = get_settings().HEALTH
    return Thresholds(**{k: float(v) for k, v in overrides.items() if k in THRESHOLD_NAMES})


class Level(IntEnum):
    HEALTHY = 0
    WARNING = 1
    CRITICAL = 2
    #: No verdict: the figures could not be read (jobstats says why). Never a reason's level.
    UNKNOWN = 3


@dataclass(frozen=True)
class Reason:
    code: str
    level: Level
    summary: str  # what is wrong, in a few words
    detail: str  # the figures behind it
    threshold: str  # the setting and the value it was judged by
    doc: str  # where the documentation explains it and what to do

    def as_dict(self) -> dict[str, str]:
        return {**asdict(self), "level": self.level.name.lower()}


@dataclass(frozen=True)
class Verdict:
    reasons: list[Reason]

    @property
    def level(self) -> Level:
        return max((reason.level for reason in self.reasons), default=Level.HEALTHY)

    @property
    def status(self) -> str:
        return self.level.name.lower()

    @property
    def exit_code(self) -> int:
        return int(self.level)


def _reason(code: str, level: Level, summary: str, detail: str, *limits: str) -> Reason:
    """A reason, with the values of the thresholds named in `limits`."""
    values = thresholds()
    used = ", ".join(f"{name} = {getattr(values, name):g}" for name in limits)
    return Reason(code, level, summary, detail, used, f"{DOC}#{code.replace('_', '-')}")


def judge(report: Figures, previous: Figures | None = None) -> Verdict:
    """The reasons the figures of `report` are not healthy (none: healthy). With the previous
    sample of a --watch, a backlog's details say how it moved since."""
    limits = thresholds()
    table_locked = locked(report.locks)
    reasons = [
        *([table_locked] if table_locked else []),
        *_behind(report, previous, limits),
        *_retry_storms(report, limits),
        *_vacuum(report, limits),
        *_database(report, limits),
        *_streams(report, limits),
        *_queue_share(report, limits),
    ]
    strained = {reason.code for reason in reasons} & {"workers_behind", "tune_autovacuum"}
    finished = sum(a.throughput for a in report.activity if a.window == 900)
    if strained and finished >= limits.ENVELOPE_JOBS_PER_SECOND:
        reasons.append(
            _reason(
                "past_the_design_envelope",
                Level.WARNING,
                "past the design envelope: consider a dedicated broker",
                f"{finished:.0f} jobs/s over 15 minutes while {' and '.join(sorted(strained))}",
                "ENVELOPE_JOBS_PER_SECOND",
            )
        )
    return Verdict(reasons)


def locked(locks: list[TableLock], waited: bool = False) -> Reason | None:
    """The job table locked against the workers (critical), else the queue controls' table
    (a warning), once a lock has been held or queued for LOCKED_SECONDS; a younger one, as a
    warning, only when the report itself gave up waiting for it (`waited`). Else None."""
    on_jobs = [lock for lock in locks if lock.table == "pgjobs_job"]
    on_controls = [lock for lock in locks if lock.table == "pgjobs_queue"]
    if reason := _locked(on_jobs, waited, "job_table_locked", "the job table is locked",
                         "; while it lasts no worker can claim a job, renew a lease or record "
                         "an outcome, and a lease that runs out meanwhile has its job run again",
                         Level.CRITICAL):  # fmt: skip
        return reason
    return _locked(
        on_controls, waited, "queue_table_locked", "the queue controls' table is locked",
        "; while it lasts workers go on with the controls as they last read them (a pause or a "
        "limit set meanwhile does not reach them), and claim nothing from queues with a limit",
        Level.WARNING,
    )  # fmt: skip


def _locked(
    locks: list[TableLock], waited: bool, code: str, summary: str, effect: str, level: Level
) -> Reason | None:
    old = [lock for lock in locks if lock.seconds >= LOCKED_SECONDS]
    if not old and not (waited and locks):
        return None
    return Reason(
        code,
        level if old else Level.WARNING,
        summary,
        "; ".join(lock.describe() for lock in locks[:3]) + effect,
        f"{'critical' if level is Level.CRITICAL else 'said'} when held or queued "
        f"{LOCKED_SECONDS:g}s (the workers' lock_timeout)",
        f"{DOC}#{code.replace('_', '-')}",
    )


def _behind(report: Figures, previous: Figures | None, limits: Thresholds) -> list[Reason]:
    served = served_queues(report.workers)
    before = {q.queue: q for q in previous.queues} if previous else {}
    carried = {stream.queue for stream in report.streams}  # their due jobs are the relay's
    reasons = []
    for q in report.queues:
        # Running jobs whose lease ran out wait too: no live worker serves the queue to reap them.
        waited = max(q.oldest_due_seconds if q.due else 0.0, q.oldest_expired_seconds)
        if q.paused or not (q.due or q.expired) or q.queue in carried:
            continue
        if q.queue not in served and waited >= limits.UNSERVED_SECONDS:
            held = (
                f"{q.expired} running whose leases ran out {q.oldest_expired_seconds:.0f}s ago "
                "(their worker is gone)"
                if q.expired
                else ""
            )
            due = f"{q.due} due, the oldest waiting {q.oldest_due_seconds:.0f}s" if q.due else ""
            reasons.append(
                _reason(
                    "no_worker_serves_a_queue",
                    Level.CRITICAL,
                    f"no worker serves {q.queue!r}",
                    f"{'; '.join(filter(None, [due, held]))}, and no live worker has this queue",
                    "UNSERVED_SECONDS",
                )
            )
        elif q.due and q.oldest_due_seconds >= limits.OLDEST_DUE_SECONDS:
            detail = f"{q.queue!r}: {q.due} due, the oldest waiting {q.oldest_due_seconds:.0f}s"
            if q.max_running is not None:
                detail += f"; at most {q.max_running} may run at once (Queue.max_running)"
            if q.queue in before:
                was = before[q.queue]
                detail += (
                    f"; since the previous sample depth {was.due} → {q.due}, "
                    f"oldest {was.oldest_due_seconds:.0f}s → {q.oldest_due_seconds:.0f}s"
                )
            reasons.append(
                _reason(
                    "workers_behind",
                    Level.WARNING,
                    "workers are behind",
                    detail,
                    "OLDEST_DUE_SECONDS",
                )
            )
    return reasons


def _retry_storms(report: Figures, limits: Thresholds) -> list[Reason]:
    return [
        _reason(
            "retry_storm",
            Level.WARNING,
            f"retry storm in {a.queue!r}",
            f"{a.retried} of {a.attempts} attempts retried in 5 minutes ({a.retry_rate:.0%})",
            "RETRY_RATE",
            "RETRY_MIN_ATTEMPTS",
        )
        for a in report.activity
        if a.window == 300
        and a.attempts >= limits.RETRY_MIN_ATTEMPTS
        and a.retry_rate >= limits.RETRY_RATE
    ]


def _vacuum(report: Figures, limits: Thresholds) -> list[Reason]:
    db, table = report.database, report.table
    held = max(db.oldest_snapshot_seconds, db.oldest_prepared_seconds)
    if held >= limits.SNAPSHOT_SECONDS:
        if db.oldest_prepared_seconds >= db.oldest_snapshot_seconds:
            holder = f"a prepared transaction {db.oldest_prepared_seconds:.0f}s old"
        else:
            holder = (
                f"pid {db.oldest_snapshot_pid} ({db.oldest_snapshot_state}), in a transaction "
                f"for {db.oldest_snapshot_seconds:.0f}s: {db.oldest_snapshot_query!r}"
            )
        return [
            _reason(
                "long_transaction",
                Level.WARNING,
                "a long transaction is blocking vacuum",
                f"{holder}; {table.dead_tuples} dead tuples wait for it",
                "SNAPSHOT_SECONDS",
            )
        ]
    # Without a held horizon, dead tuples piling up mean autovacuum does not keep up.
    dead, live = table.dead_tuples, table.live_tuples
    if dead >= limits.DEAD_TUPLES and dead >= limits.DEAD_RATIO * live:
        last = table.last_autovacuum.isoformat() if table.last_autovacuum else "never"
        return [
            _reason(
                "tune_autovacuum",
                Level.WARNING,
                "tune autovacuum",
                f"{dead} dead tuples against {live} live; last autovacuum {last}",
                "DEAD_TUPLES",
                "DEAD_RATIO",
            )
        ]
    return []


def _database(report: Figures, limits: Thresholds) -> list[Reason]:
    db, reasons = report.database, []
    if db.refuses_writes:
        why = {"in recovery": "it is a standby: pg_is_in_recovery()"}.get(
            db.refuses_writes, "default_transaction_read_only is on for the database"
        )
        reasons.append(
            _reason(
                "database_refuses_writes",
                Level.CRITICAL,
                "the database refuses writes",
                f"{why}; workers can claim, run and record nothing there (after a failover, "
                "they and this report may still be connected to the old primary or a replica)",
            )
        )
    if db.connections_ratio >= limits.CONNECTIONS_RATIO:
        reasons.append(
            _reason(
                "connections_near_the_limit",
                Level.WARNING,
                "connections near the limit",
                f"{db.connections_used} of {db.connections_max} connections in use",
                "CONNECTIONS_RATIO",
            )
        )
    if db.notify_queue_usage >= limits.NOTIFY_QUEUE_USAGE:
        reasons.append(
            _reason(
                "notify_queue_filling",
                Level.WARNING,
                "the NOTIFY queue is filling up",
                f"pg_notification_queue_usage() = {db.notify_queue_usage:.0%}; a listener is "
                "not reading its notifications",
                "NOTIFY_QUEUE_USAGE",
            )
        )
    return reasons


def _messages(count: int) -> str:
    return "1 message" if count == 1 else f"{count} messages"


def _unserved(stream: StreamStats) -> str:
    """What waits in a NATS queue no live worker serves, and since when."""
    said = []
    if stream.pending:
        waited = stream.oldest_pending_seconds
        said.append(
            f"{_messages(stream.pending)} not yet delivered"
            + (
                f" (the oldest one's age could not be read: {stream.age_error or 'unknown'})"
                if waited is None
                else f", the oldest due {waited:.0f}s ago"
            )
        )
    if stream.ack_pending and stream.oldest_unacked_seconds is not None:
        said.append(
            f"{_messages(stream.ack_pending)} delivered to workers that are gone, the oldest due "
            f"{stream.oldest_unacked_seconds:.0f}s ago"
        )
    return "; ".join(said)


def _streams(report: Figures, limits: Thresholds) -> list[Reason]:
    """The queues carried by NATS: the server unreachable, the relay behind (due jobs waiting in
    the outbox), the consumer's workers behind or absent."""
    reasons = []
    served = served_queues(report.workers)
    outbox = {q.queue: q for q in report.queues}
    for stream in report.streams:
        if not stream.reachable:
            reasons.append(
                _reason(
                    "nats_unreachable",
                    Level.CRITICAL,
                    f"NATS unreachable for {stream.queue!r}",
                    f"stream {stream.stream}: {stream.error}; its jobs wait in the outbox",
                    "RELAY_LAG_SECONDS",
                )
            )
            continue
        waiting = outbox.get(stream.queue)
        if waiting and waiting.due and waiting.oldest_due_seconds >= limits.RELAY_LAG_SECONDS:
            reasons.append(
                _reason(
                    "relay_behind",
                    Level.WARNING,
                    f"the relay is behind for {stream.queue!r}",
                    f"{waiting.due} due jobs in the outbox, the oldest waiting "
                    f"{waiting.oldest_due_seconds:.0f}s; is a runjobs or relayjobs running?",
                    "RELAY_LAG_SECONDS",
                )
            )
        if waiting and waiting.paused:
            continue  # its workers fetch nothing on purpose, as for a PostgreSQL queue
        # As for a PostgreSQL queue, only past UNSERVED_SECONDS (a deploy leaves messages
        # unserved for a moment); an age that could not be read counts as old enough.
        waited = stream.oldest_pending_seconds
        unacked = stream.oldest_unacked_seconds or 0.0
        if stream.queue not in served and (
            (stream.pending and (waited is None or waited >= limits.UNSERVED_SECONDS))
            or (stream.ack_pending and unacked >= limits.UNSERVED_SECONDS)
        ):
            reasons.append(
                _reason(
                    "no_worker_serves_a_queue",
                    Level.CRITICAL,
                    f"no worker serves {stream.queue!r}",
                    f"{_unserved(stream)} in stream {stream.stream}, and no live worker has this "
                    "queue",
                    "UNSERVED_SECONDS",
                )
            )
        elif stream.pending >= limits.NATS_PENDING:
            reasons.append(
                _reason(
                    "workers_behind",
                    Level.WARNING,
                    "workers are behind",
                    f"{stream.queue!r}: {stream.pending} messages not yet delivered by consumer "
                    f"{stream.consumer}, {stream.ack_pending} running",
                    "NATS_PENDING",
                )
            )
    return reasons


def _queue_share(report: Figures, limits: Thresholds) -> list[Reason]:
    load = report.load
    if load is None or load.share is None or load.share < limits.QUEUE_SHARE:
        return []
    return [
        _reason(
            "queue_takes_the_database",
            Level.WARNING,
            "the queue takes much of the database's time",
            f"the job queue's statements: {load.describe()}",
            "QUEUE_SHARE",
        )
    ]
