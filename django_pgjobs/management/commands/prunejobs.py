"""manage.py prunejobs: delete old succeeded and cancelled jobs in bounded batches."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_pgjobs.conf import get_settings
from django_pgjobs.models import Job


class Command(BaseCommand):
    help = (
        "Delete succeeded and cancelled jobs that finished longer ago than the retention "
        "(PGJOBS['RETENTION'] unless --older-than is given), PGJOBS['PRUNE_BATCH'] rows per "
        "statement. Dead letters (failed jobs) are kept until you delete them."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=float,
            metavar="SECONDS",
            help=f"retention in seconds (default {get_settings().RETENTION.total_seconds():g})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        seconds = options["older_than"]
        older_than = None if seconds is None else timedelta(seconds=max(0.0, seconds))
        count = Job.objects.prune(older_than=older_than)
        self.stdout.write(f"pruned {count} finished jobs")
