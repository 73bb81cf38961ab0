"""The relay: publishes the outbox (the due rows of NATS queues) to the queues' streams.

Each round is one short transaction (JobManager.relay): take a batch of due rows with SKIP
LOCKED, publish each with its message id, wait for the stream's acknowledgements, and commit
the rows' deletion. A relay that dies before its commit leaves the rows to the next round,
and the stream drops the second publish of a message id within its duplicate window; so a job
committed by its enqueuer reaches the stream once, and a job rolled back never does.

Runs on a thread of every `runjobs` while a queue uses NATS (`--no-relay` to leave it to
others; with `--once`, as a chore of its loop), and alone as `manage.py relayjobs`. Several
relays share the work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from django.db import DatabaseError, connections

from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.records import Failure
from django_pgjobs.jetstream import messages, streams
from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.models import Job
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.logs import quietly
from django_pgjobs.runtime.outages import Outage
from django_pgjobs.runtime.policy import outage_pause
from django_pgjobs.transports import NatsQueue

logger = logging.getLogger(__name__)

#: Seconds between rounds while the outbox is empty (a commit's wake-up cuts the wait short).
RELAY_INTERVAL = 0.5

#: The worker a job the relay dead-letters is recorded as held by.
RELAY_WORKER = "relay"


class Relay:
    """Publishes the outbox rows of `queues` through `bridge`, `batch` rows per round."""

    def __init__(
        self, jobs: JobManager, bridge: Bridge, queues: Mapping[str, NatsQueue], batch: int
    ) -> None:
        self.jobs, self.bridge, self.queues, self.batch = jobs, bridge, queues, batch
        self._streams_ready = False
        self.relayed = 0  # since the start, for the logs and the benchmark

    def round(self) -> int:
        """One transaction: publish up to `batch` due rows per queue; returns how many."""
        if not self._streams_ready:
            for queue in self.queues.values():
                streams.ensure_stream(self.bridge, queue)
            self._streams_ready = True
        jobs = self.jobs.relay(list(self.queues), limit=self.batch, publish=self._publish)
        self.relayed += len(jobs)
        return len(jobs)

    def forget_streams(self) -> None:
        """Make sure of the streams again before the next round."""
        self._streams_ready = False

    def _publish(self, jobs: list[Job]) -> None:
        """Publish `jobs`; one whose message the server would refuse as too large becomes a
        dead letter saying so, in the same transaction: retried, it would fail every round and
        hold back every job of every NATS queue behind it (and those published with it would be
        published again, round after round)."""
        limit = self.bridge.client.max_payload
        outgoing = []
        for job in jobs:
            body = messages.body(job)
            if len(body) > limit:
                self._refuse(job, len(body), limit)
            else:
                outgoing.append((self.queues[job.queue].subject, body, messages.headers(job)))
        if outgoing:
            self.bridge.publish(outgoing)

    def _refuse(self, job: Job, size: int, limit: int) -> None:
        job.worker, job.attempts, job.claims = RELAY_WORKER, job.attempts + 1, job.claims + 1
        too_large = Failure(
            "django_pgjobs.MessageTooLarge",
            f"its message is {size:,} bytes, over the NATS server's max_payload of {limit:,}: "
            "store large data elsewhere and pass its id (or raise max_payload on the server)",
        )
        self.jobs.write_back(job, too_large, permanent=True, delay=0)
        quietly(logger.error, "relay: job %s (%s): %s", job.pk, job.task, too_large.message)


class RelayChore(Chore):
    """A worker's relay rounds: at once again while rounds come back full, every
    RELAY_INTERVAL while idle, backing off while NATS cannot be reached. A database error
    pauses it as any chore's does (Chore.run_if_due); a NATS error is logged here."""

    def __init__(self, relay: Relay) -> None:
        super().__init__()
        self.relay = relay
        self._failures = 0

    def run(self) -> float:
        try:
            count = self.relay.round()
        except DatabaseError:
            raise
        except Exception as error:
            self._failures += 1
            pause = outage_pause(self._failures)
            logger.warning(
                "relay: could not publish to NATS (%s: %s); trying again in %.1fs",
                type(error).__name__, error, pause,
            )  # fmt: skip
            self.relay.forget_streams()  # the server may have lost them
            return pause
        self._failures = 0
        return 0.0 if count >= self.relay.batch else RELAY_INTERVAL

    def wake(self) -> None:
        """An enqueue to a NATS queue committed: relay at the next turn."""
        self.next_at = time.monotonic()


def relay_until(relay: Relay, stopped: threading.Event, once: bool = False) -> None:
    """Relay rounds on this thread until `stopped` is set (with `once`, until a round comes
    back short: the outbox is drained), riding out database outages as a worker does."""
    chore, outage = RelayChore(relay), Outage()
    try:
        while not stopped.is_set():
            try:
                wait = chore.run()
                outage.over()
            except DatabaseError as error:
                connections[relay.jobs.db].close()
                wait = outage.failed(error)
            if once and wait > 0:
                return
            stopped.wait(wait)
    finally:
        connections.close_all()  # this thread's
