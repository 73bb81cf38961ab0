"""manage.py prunejobs: delete finished jobs older than their status's retention, in bounded
batches; --dry-run counts them instead."""

from __future__ import annotations

from argparse import ArgumentTypeError
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count

from django_pgjobs.conf import get_settings
from django_pgjobs.models import Job


def _seconds(value: str) -> timedelta:
    try:
        seconds = float(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise ArgumentTypeError(f"must be 0 or more seconds, got {value}")
    return timedelta(seconds=seconds)


def _describe(age: timedelta | None) -> str:
    return "kept" if age is None else f"{age.total_seconds():g}s"


class Command(BaseCommand):
    help = (
        "Delete finished jobs older than the retention of their status (PGJOBS['RETENTION']: "
        "succeeded and cancelled jobs after an hour, dead letters kept, by default), "
        "PGJOBS['PRUNE_BATCH'] rows per statement. --dry-run counts them instead."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        retention = get_settings().retention()
        parser.add_argument(
            "--older-than",
            type=_seconds,
            metavar="SECONDS",
            help="retention of succeeded and cancelled jobs for this run "
            f"(default {_describe(retention['succeeded'])} and "
            f"{_describe(retention['cancelled'])})",
        )
        parser.add_argument(
            "--failed-older-than",
            type=_seconds,
            metavar="SECONDS",
            help="also delete dead letters (failed jobs) that finished this long ago "
            f"(default {_describe(retention['failed'])})",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="count what would be deleted, by status, and delete nothing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        retention = get_settings().retention()
        if options["older_than"] is not None:
            retention.update(succeeded=options["older_than"], cancelled=options["older_than"])
        if options["failed_older_than"] is not None:
            retention["failed"] = options["failed_older_than"]
        if options["dry_run"]:
            # A count reads every finished row older than its retention: fine for a one-off.
            counts = dict(
                Job.objects.prunable(retention)
                .values_list("status")
                .annotate(jobs=Count("*"))
                .order_by()
            )
            for status, age in retention.items():
                self.stdout.write(
                    f"{status}: {counts.get(status, 0)} would be pruned (retention "
                    f"{_describe(age)})"
                )
            return
        count = Job.objects.prune(retention=retention)
        self.stdout.write(f"pruned {count} finished jobs")
