"""manage.py relayjobs: publish the outbox of NATS queues (their due rows) until SIGTERM/SIGINT,
without running any job (runjobs does this as a chore unless given --no-relay)."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections, router

from django_pgjobs import transports
from django_pgjobs.models import Job
from django_pgjobs.runtime.outages import Outage


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
        from django_pgjobs.jetstream import workers  # needs nats-py: only when used

        chore = workers.relay_chore()
        db = router.db_for_write(Job)
        stopped = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stopped.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        outage = Outage()
        try:
            while not stopped.is_set():
                try:
                    wait = chore.run()
                    outage.over()
                except DatabaseError as error:
                    connections[db].close()
                    wait = outage.failed(error)
                if options["once"] and wait > 0:
                    break
                stopped.wait(wait)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            chore.relay.bridge.close()
        self.stdout.write(
            f"relayed {chore.relay.relayed} jobs in {time.process_time():.1f}s of CPU"
        )
