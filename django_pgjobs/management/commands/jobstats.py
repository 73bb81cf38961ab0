"""manage.py jobstats: queue depth and age, retries, dead letters, and the table's health."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_pgjobs import stats


class Command(BaseCommand):
    help = (
        "Show queue depth, the age of the oldest due job, retries waiting, running jobs, dead "
        "letters, and the job table's dead tuples, autovacuum, size, connections and oldest "
        "snapshot."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(stats.as_dict(), default=str, indent=2))
            return
        header = f"{'queue':<20} {'due':>8} {'scheduled':>9} {'retrying':>8} {'running':>7}"
        self.stdout.write(f"{header} {'failed':>7} {'oldest due':>10}")
        for q in stats.queue_stats():
            self.stdout.write(
                f"{q.queue:<20} {q.due:>8} {q.scheduled:>9} {q.retrying:>8} {q.running:>7} "
                f"{q.failed:>7} {q.oldest_due_seconds:>9.1f}s"
            )
        t = stats.table_stats()
        self.stdout.write(
            f"\ntable: {t.live_tuples} live, {t.dead_tuples} dead tuples; "
            f"{t.table_bytes / 2**20:.1f} MiB heap + {t.index_bytes / 2**20:.1f} MiB indexes"
        )
        self.stdout.write(
            f"autovacuum: last {t.last_autovacuum or 'never'} ({t.autovacuum_count} runs); "
            f"last autoanalyze {t.last_autoanalyze or 'never'}"
        )
        connections = ", ".join(f"{n} {state}" for state, n in sorted(t.connections.items()))
        self.stdout.write(f"connections: {connections}")
        self.stdout.write(
            f"oldest snapshot: {t.oldest_snapshot_seconds:.0f}s"
            + (f" ({t.oldest_snapshot_query!r})" if t.oldest_snapshot_seconds >= 60 else "")
        )
