"""manage.py jobstats: the health report (queues, workers, the table, the database) and its
verdict, with a monitoring plugin's exit status (see `help`)."""

from __future__ import annotations

import json
import time
from argparse import ArgumentTypeError
from traceback import format_exception
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, SystemCheckError
from django.db import DatabaseError

from django_pgjobs.conf import get_settings
from django_pgjobs.observability import report as reports
from django_pgjobs.observability.health import Level
from django_pgjobs.observability.report import NoReport, Report, no_report
from django_pgjobs.observability.stats import WINDOWS, window_label

CLEAR = "\x1b[H\x1b[2J"


def _seconds_between(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ArgumentTypeError(f"must be more than 0 seconds between samples, got {value}")
    return seconds


class Command(BaseCommand):
    help = (
        "Report per queue the jobs due, scheduled, retrying, running and failed, the oldest due "
        "job's age, throughput, retry rate and claim latency; the job table's size, tuples and "
        "vacuum; the database's oldest snapshot, idle transactions, NOTIFY queue and "
        "connections; the batches open and completed without succeeding, and the jobs waiting "
        "for others; then a health verdict. Exit status: 0 healthy, 1 warning, 2 critical "
        "(also: the database cannot be used, the pgjobs tables are missing, or the job table is "
        "locked against the workers), 3 unknown "
        "(the report could not be taken)."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        usage_error = parser.exit

        def exit(status: int = 0, message: str | None = None) -> Any:
            # argparse exits 2 on a bad command line, which a probe would read as critical.
            return usage_error(int(Level.UNKNOWN) if status == 2 else status, message)

        parser.exit = exit  # type: ignore[method-assign]
        return parser

    def check(self, *args: Any, **kwargs: Any) -> None:
        # A failing check exits 1, a probe's "warning": the report was not taken, so it is unknown.
        try:
            super().check(*args, **kwargs)
        except SystemCheckError as error:
            raise CommandError(str(error), returncode=int(Level.UNKNOWN)) from error

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")
        parser.add_argument(
            "--watch",
            nargs="?",
            const=5.0,
            type=_seconds_between,
            metavar="SECONDS",
            help="refresh every SECONDS (default 5) until interrupted; the verdict then also "
            "says how backlogs moved since the previous sample",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        interval = options["watch"]
        previous: Report | None = None
        sample: Report | NoReport | None = None
        try:
            while True:
                sample = self.take(previous, options["traceback"])
                if isinstance(sample, Report):
                    previous = sample
                self.show(sample, options["json"], interval)
                if not interval:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            if sample is None:
                raise
        # The last sample's verdict, also after Ctrl-C ends a --watch.
        code = sample.level if isinstance(sample, NoReport) else sample.verdict.exit_code
        if code:
            raise SystemExit(int(code))

    def take(self, previous: Report | None, traceback: bool) -> Report | NoReport:
        """The report, or why it could not be taken (the --traceback option raises instead)."""
        try:
            return reports.collect(previous=previous)
        except Exception as error:
            if traceback:
                raise
            if isinstance(error, DatabaseError):
                return no_report(error)
            # A bug or a broken setting: "unknown", not exit 1 ("warning"); the traceback to stderr.
            self.stderr.write("".join(format_exception(error)))
            return NoReport(Level.UNKNOWN, f"jobstats failed: {type(error).__name__}: {error}")

    def show(self, sample: Report | NoReport, as_json: bool, interval: float | None) -> None:
        if as_json:
            indent = None if interval else 2  # one document per line when watching
            data = reports.as_dict(sample) if isinstance(sample, Report) else no_data(sample)
            self.stdout.write(json.dumps(data, default=str, indent=indent))
            return
        if interval and self.stdout.isatty():
            self.stdout.write(CLEAR, ending="")
        if isinstance(sample, NoReport):
            self.stdout.write(f"verdict: {sample.level.name}: {sample.why}")
        else:
            self.stdout.write(render(sample))


def no_data(sample: NoReport) -> dict[str, Any]:
    """A sample that could not be taken, as --json prints it."""
    data: dict[str, Any] = {"status": sample.level.name.lower(), "error": sample.why}
    if sample.reason is not None:
        data["reasons"] = [sample.reason.as_dict()]
    return data


def render(report: Report) -> str:
    """The report as text for a terminal."""
    lines = [f"django-pgjobs at {report.at:%Y-%m-%d %H:%M:%S %Z}", ""]
    lines.append(
        f"{'queue':<20} {'due':>7} {'scheduled':>9} {'retrying':>8} {'running':>7} "
        f"{'failed':>7} {'oldest due':>10} {'workers':>7}"
    )
    for q in report.queues:
        name = f"{q.queue} (paused)" if q.paused else q.queue
        lines.append(
            f"{name:<20} {q.due:>7} {q.scheduled:>9} {q.retrying:>8} {q.running:>7} "
            f"{q.failed:>7} {_seconds(q.oldest_due_seconds):>10} {len(report.serving(q.queue)):>7}"
        )
        if q.expired:  # their workers gone: nobody runs them until a live worker's reaper
            lines.append(
                f"{'':<20} {q.expired} of them running with a lease that ran out "
                f"{_seconds(q.oldest_expired_seconds)} ago"
            )
    if report.activity:
        lines.append("")
        lines.append(
            f"{'activity':<20} {'window':>6} {'claimed':>8} {'jobs/s':>8} {'retried':>7} "
            f"{'failed':>7} {'retry %':>7} {'p50':>7} {'p95':>7}"
        )
        for a in sorted(report.activity, key=lambda a: (a.queue, a.window)):
            lines.append(
                f"{a.queue:<20} {window_label(a.window):>6} {a.claimed:>8} {a.throughput:>8.1f} "
                f"{a.retried:>7} {a.failed:>7} {a.retry_rate:>7.0%} "
                f"{_latency(a.latency(0.5)):>7} {_latency(a.latency(0.95)):>7}"
            )
    lines += _streams(report)
    lines += _yielding(report)
    lines += _limits(report)
    lines += _batches(report)
    lines += ["", _workers(report), *_table(report), *_database(report), ""]
    lines.append(f"verdict: {report.verdict.status.upper()}")
    for reason in report.verdict.reasons:
        lines.append(f"  {reason.level.name.lower():<8} {reason.summary}: {reason.detail}")
        judged = f"threshold {reason.threshold}; " if reason.threshold else ""
        lines.append(f"  {'':<8} {judged}see {reason.doc}")
    return "\n".join(lines)


def _streams(report: Report) -> list[str]:
    """The queues carried by NATS: each one's outbox (its due jobs above), stream and consumer."""
    if not report.streams:
        return []
    lines = ["", f"{'NATS queue':<20} {'outbox':>7} {'oldest':>7} {'stream':>8} {'pending':>8} "
                 f"{'oldest':>7} {'acks due':>8} {'oldest':>7} {'redeliv.':>8}"]  # fmt: skip
    depths = {q.queue: q for q in report.queues}
    for s in report.streams:
        q = depths.get(s.queue)
        outbox, oldest = (q.due, _seconds(q.oldest_due_seconds)) if q else (0, "-")
        if not s.reachable:
            lines.append(f"{s.queue:<20} {outbox:>7} {oldest:>7} unreachable: {s.error}")
            continue
        pending = _age(s.pending, s.oldest_pending_seconds)
        unacked = _age(s.ack_pending, s.oldest_unacked_seconds)
        lines.append(
            f"{s.queue:<20} {outbox:>7} {oldest:>7} {s.messages:>8} {s.pending:>8} "
            f"{pending:>7} {s.ack_pending:>8} {unacked:>7} {s.redelivered:>8}"
        )
        if s.age_error:
            lines.append(f"{'':<20} the ages could not be read: {s.age_error}")
    return lines


def _yielding(report: Report) -> list[str]:
    """One line per queue served: whether it yields to the application, how much and why."""
    settings = get_settings()
    lines = []
    for q in report.queues:
        if not report.serving(q.queue):
            continue
        if settings.yield_budget(q.queue) is None:
            lines.append(f"{q.queue:<20} never yields (YIELD_BUDGET None)")
        elif (y := report.yielding_of(q.queue)) is not None:
            lines.append(f"{q.queue:<20} {y.describe()}")
    return ["", "yielding to the application", *lines] if lines else []


def _limits(report: Report) -> list[str]:
    """One line per limited task with jobs due or running (docs/howto/flow-control.md)."""
    lines = []
    for use in report.limits:
        keys = use.waiting_keys > 1 or use.running_keys > 1
        waiting = f"{use.waiting} waiting" + (f" over {use.waiting_keys} keys" if keys else "")
        running = f"{use.running} running" + (f" over {use.running_keys} keys" if keys else "")
        lines.append(f"{use.task}: {use.limits or 'limits unknown here'}; {running}, {waiting}")
    return ["", "limited tasks", *lines] if lines else []


def _batches(report: Report) -> list[str]:
    """The batches not yet succeeded and the jobs waiting for others, when there are any."""
    b = report.batches
    waiting = f"{b.waiting} jobs waiting (after=)"
    if not b.readable:
        return ["", f"batches: not counted: this database user may not read pgjobs_batch "
                    f"(grant it SELECT); {waiting}"]  # fmt: skip
    if not (b.open or b.completed_not_succeeded or b.waiting):
        return []
    return [
        "",
        f"batches: {b.open} open, {b.completed_not_succeeded} completed, not succeeded "
        f"(failed or cancelled jobs to replay); {waiting}",
    ]


def _age(count: int, seconds: float | None) -> str:
    """How long the oldest of `count` messages has been due: "-" for none, "?" unread."""
    if not count:
        return "-"
    return "?" if seconds is None else _seconds(seconds)


def _workers(report: Report) -> str:
    alive = report.alive
    text = f"workers: {len(alive)} alive"
    if alive:
        text += " (" + "; ".join(f"{w.worker}: {', '.join(w.queues)}" for w in alive) + ")"
    for gone, workers in (("silent", report.silent), ("stopped", report.stopped)):
        if workers:
            seen = ", ".join(f"{w.worker} {_seconds(w.last_seen_seconds)} ago" for w in workers)
            text += f"; {gone} in the last {max(WINDOWS) // 60} minutes: {seen}"
    return text


def _table(report: Report) -> list[str]:
    t = report.table
    largest = sorted(t.indexes.items(), key=lambda item: -item[1])
    return [
        f"table: {t.live_tuples} live, {t.dead_tuples} dead tuples; heap {_mib(t.table_bytes)}, "
        f"indexes {_mib(t.index_bytes)}",
        "indexes: " + ", ".join(f"{name} {_mib(size)}" for name, size in largest),
        f"vacuum: last autovacuum {t.last_autovacuum or 'never'} ({t.autovacuum_count} runs), "
        f"last vacuum {t.last_vacuum or 'never'}; last autoanalyze "
        f"{t.last_autoanalyze or 'never'}, last analyze {t.last_analyze or 'never'}",
    ]


def _database(report: Report) -> list[str]:
    d = report.database
    states = ", ".join(f"{n} {state}" for state, n in sorted(d.connections.items()))
    lines = [
        f"connections: {d.connections_used} of {d.connections_max} ({d.connections_ratio:.0%}); "
        f"this database: {states or 'none'}",
        f"idle in transaction: {d.idle_in_transaction}"
        + (f", the longest for {_seconds(d.idle_in_transaction_seconds)}"
           if d.idle_in_transaction else ""),
        f"NOTIFY queue: {d.notify_queue_usage:.0%} used",
        f"oldest snapshot: {_seconds(d.oldest_snapshot_seconds)}, {d.oldest_snapshot_xids} xids"
        + (f" (pid {d.oldest_snapshot_pid}, {d.oldest_snapshot_state}: "
           f"{d.oldest_snapshot_query!r})" if d.oldest_snapshot_seconds >= 60 else ""),
    ]  # fmt: skip
    if not d.sees_all_sessions:
        lines.append(
            "(other users' sessions are hidden from this database user: connections, idle "
            "transactions and the oldest snapshot count its own; grant it pg_monitor to see all)"
        )
    if d.oldest_prepared_seconds:
        lines.append(f"oldest prepared transaction: {_seconds(d.oldest_prepared_seconds)}")
    for slot, active, xids in d.slots:
        lines.append(f"replication slot {slot} ({'active' if active else 'inactive'}): {xids} xids")
    if report.load is not None:
        lines.append(f"the queue's share of the database's active time: {report.load.describe()}")
    return lines


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 10 else f"{value:.0f}s"


def _latency(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
