"""manage.py relayjobs: publish the outbox of NATS queues (their due rows) until SIGTERM/SIGINT,
without running any job (every runjobs does it too, unless given --no-relay)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pgjobs import transports


class Command(BaseCommand):
    help = (
        "Relay the jobs enqueued to NATS queues (PGJOBS['QUEUES']) from the job table to their "
        "JetStream streams, in batches, each row deleted once the stream acknowledged it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="relay what is due now, then exit")

    def handle(self, *args: Any, **options: Any) -> None:
        if not transports.nats_queues():
            raise CommandError("No queue uses NATS: set PGJOBS['QUEUES'][name]['TRANSPORT'].")
        from django_pgjobs.jetstream import relay  # needs nats-py: only when used

        stopped = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stopped.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            relayed = relay.relay_alone(stopped, once=options["once"])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.stdout.write(f"relayed {relayed} jobs")
