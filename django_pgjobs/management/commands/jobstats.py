"""manage.py jobstats: the health report (queues, workers, the table, the database) and its
verdict; exits 0 when healthy, 1 on a warning, 2 when critical."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_pgjobs.observability import report as reports
from django_pgjobs.observability.report import Report
from django_pgjobs.observability.stats import WINDOWS, window_label

CLEAR = "\x1b[H\x1b[2J"


class Command(BaseCommand):
    help = (
        "Report per queue the jobs due, scheduled, retrying, running and failed, the oldest due "
        "job's age, throughput, retry rate and claim latency; the job table's size, tuples and "
        "vacuum; the database's oldest snapshot, idle transactions, NOTIFY queue and "
        "connections; then a health verdict. Exit status: 0 healthy, 1 warning, 2 critical."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")
        parser.add_argument(
            "--watch",
            nargs="?",
            const=5.0,
            type=float,
            metavar="SECONDS",
            help="refresh every SECONDS (default 5) until interrupted; the verdict then also "
            "says how backlogs moved since the previous sample",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        interval = options["watch"]
        report: Report | None = None
        try:
            while True:
                report = reports.collect(previous=report)
                self.show(report, options["json"], interval)
                if not interval:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            if report is None:
                raise
        # The last sample's verdict, also after Ctrl-C ends a --watch.
        if report.verdict.exit_code:
            raise SystemExit(report.verdict.exit_code)

    def show(self, report: Report, as_json: bool, interval: float | None) -> None:
        if as_json:
            indent = None if interval else 2  # one document per line when watching
            self.stdout.write(json.dumps(reports.as_dict(report), default=str, indent=indent))
            return
        if interval and self.stdout.isatty():
            self.stdout.write(CLEAR, ending="")
        self.stdout.write(render(report))


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
    lines += ["", _workers(report), *_table(report), *_database(report), ""]
    lines.append(f"verdict: {report.verdict.status.upper()}")
    for reason in report.verdict.reasons:
        lines.append(f"  {reason.level.name.lower():<8} {reason.summary}: {reason.detail}")
        lines.append(f"  {'':<8} threshold {reason.threshold}; see {reason.doc}")
    return "\n".join(lines)


def _workers(report: Report) -> str:
    alive, silent = report.alive, report.silent
    text = f"workers: {len(alive)} alive"
    if alive:
        text += " (" + "; ".join(f"{w.worker}: {', '.join(w.queues)}" for w in alive) + ")"
    if silent:
        gone = ", ".join(f"{w.worker} {_seconds(w.last_seen_seconds)} ago" for w in silent)
        text += f"; silent in the last {max(WINDOWS) // 60} minutes: {gone}"
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
