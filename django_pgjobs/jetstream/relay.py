"""The relay: publishes the outbox (the due rows of NATS queues) to the queues' streams.

Each round is one short transaction (JobManager.relay): take a batch of due rows with SKIP
LOCKED, publish each with its message id, wait for the stream's acknowledgements, and commit
the deletion of the rows whose messages the stream acknowledged. The others stay in the outbox:
a relay that dies before its commit, or a message the stream did not acknowledge, leaves its
row to a later round, and the stream drops the second publish of a message id within its
duplicate window; so a job committed by its enqueuer reaches the stream once, and a job rolled
back never does.

A queue whose stream cannot be made, or one of whose messages was not acknowledged (no
permission to publish on its subject, a stream without a leader, a round too slow for
PUBLISH_TIMEOUT), is said in the log and left out of the rounds for a while, backing off as
an outage does; the other queues relay on.

Runs on a thread of every `runjobs` while a queue uses NATS (`--no-relay` to leave it to
others; with `--once`, as a chore of its loop), and alone as `manage.py relayjobs`. Several
relays share the work.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping
from uuid import UUID

from django.db import DatabaseError, connections, router

from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.records import Failure
from django_pgjobs.jetstream import messages, streams
from django_pgjobs.jetstream.bridge import Bridge, Outgoing
from django_pgjobs.models import Job
from django_pgjobs.runtime import sessions as locks
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.policy import outage_pause
from django_pgjobs.runtime.reporting import Outage, log_safely
from django_pgjobs.transports import NatsQueue, nats_queues, nats_servers

logger = logging.getLogger(__name__)

#: Seconds between rounds while the outbox is empty (a commit's wake-up cuts the wait short).
RELAY_INTERVAL = 0.5

#: The worker a job the relay dead-letters is recorded as held by.
RELAY_WORKER = "relay"

#: The most bytes (bodies and headers) a round publishes, beyond its first message: a round
#: must be acknowledged within PUBLISH_TIMEOUT, and 500 messages of a megabyte are not, on
#: most links. What is left waits for the next round, which follows at once.
ROUND_BYTES = 8 * 1024 * 1024


class Relay:
    """Publishes the outbox rows of `queues` through `bridge`, `batch` rows per round."""

    def __init__(
        self, jobs: JobManager, bridge: Bridge, queues: Mapping[str, NatsQueue], batch: int
    ) -> None:
        self.jobs, self.bridge, self.queues, self.batch = jobs, bridge, queues, batch
        self._streams_ready: set[str] = set()
        self._failing: dict[str, tuple[int, float]] = {}  # queue: failures in a row, until
        self._unsent: dict[str, list[tuple[Job | None, Exception]]] = {}  # this round's, by queue
        self.cut_short = False  # the last round left due rows for the next (ROUND_BYTES)
        self.relayed = 0  # since the start, for the logs and the benchmark

    def round(self) -> int:
        """One transaction: publish up to `batch` due rows per queue, except queues backing
        off after a failure; returns how many are done with (relayed, or refused)."""
        now, self._unsent, self.cut_short = time.monotonic(), {}, False
        taking = []
        for name, queue in self.queues.items():
            if self._failing.get(name, (0, 0.0))[1] > now:
                continue
            if name not in self._streams_ready:
                try:
                    streams.ensure_stream(self.bridge, queue)
                except Exception as error:  # that queue's alone: the others relay on
                    self._unsent[name] = [(None, error)]
                    continue
                self._streams_ready.add(name)
            taking.append(name)
        jobs = self.jobs.relay(taking, limit=self.batch, publish=self._publish) if taking else []
        for name in taking:
            if name not in self._unsent:
                self._failing.pop(name, None)
        for name, unsent in self._unsent.items():
            self._back_off(name, unsent)
        self.relayed += len(jobs)
        return len(jobs)

    def forget_streams(self) -> None:
        """Make sure of the streams again before the next round."""
        self._streams_ready.clear()

    def _back_off(self, queue: str, unsent: list[tuple[Job | None, Exception]]) -> None:
        """Leave `queue` out of the rounds for a while: `unsent` (its jobs whose messages the
        stream did not acknowledge, and why; None for a stream that could not be made) stay
        in the outbox, to be published again."""
        failures = self._failing.get(queue, (0, 0.0))[0] + 1
        pause = outage_pause(failures)
        self._failing[queue] = (failures, time.monotonic() + pause)
        self._streams_ready.discard(queue)  # the server may have lost it
        job, error = unsent[0]
        if job is None:
            what = f"could not make its stream {self.queues[queue].stream}"
        else:
            what = f"{len(unsent)} messages were not acknowledged by its stream (job {job.pk}"
            what += f", {job.task}, among them)"
        log_safely(
            logger.warning,
            "relay: queue %r: %s (%s: %s); they stay in the outbox, the queue is tried again "
            "in %.1fs, the other queues relay on",
            queue, what, type(error).__name__, error, pause,
        )  # fmt: skip

    def _publish(self, jobs: list[Job]) -> set[UUID]:
        """Publish `jobs` (up to ROUND_BYTES of them); returns the ids of those done with: the
        stream acknowledged their messages, or they were refused. One whose message the
        server would refuse as too large becomes a dead letter saying so, in the same
        transaction: retried, it would fail every round (and the server's refusal would close
        the connection)."""
        limit = self.bridge.client.max_payload
        done: set[UUID] = set()
        outgoing: list[Outgoing] = []
        sending: list[Job] = []
        size = 0
        for job in jobs:
            body, headers = messages.body(job), messages.headers(job)
            if (message_size := messages.size(body, headers)) > limit:
                self._refuse(job, message_size, limit)
                done.add(job.pk)
                continue
            size += message_size
            if sending and size > ROUND_BYTES:
                self.cut_short = True
                break
            outgoing.append((self.queues[job.queue].subject, body, headers))
            sending.append(job)
        for job, error in zip(sending, self.bridge.publish_each(outgoing), strict=True):
            if error is None:
                done.add(job.pk)
            else:
                self._unsent.setdefault(job.queue, []).append((job, error))
        return done

    def _refuse(self, job: Job, size: int, limit: int) -> None:
        job.worker = RELAY_WORKER
        too_large = Failure(
            "django_pgjobs.MessageTooLarge",
            f"its message is {size:,} bytes, over the NATS server's max_payload of {limit:,}: "
            "store large data elsewhere and pass its id (or raise max_payload on the server)",
        )
        self.jobs.refuse_relayed(job, too_large)
        log_safely(logger.error, "relay: job %s (%s): %s", job.pk, job.task, too_large.message)


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
        return 0.0 if count >= self.relay.batch or self.relay.cut_short else RELAY_INTERVAL

    def wake(self) -> None:
        """An enqueue to a NATS queue committed: relay at the next turn."""
        self.next_at = time.monotonic()


def relay_until(relay: Relay, stopped: threading.Event, once: bool = False) -> None:
    """Relay rounds on this thread until `stopped` is set (with `once`, until a round comes
    back short: the outbox is drained), riding out database outages as a worker does."""
    chore, outage = RelayChore(relay), Outage("the relay", prefix="relay: ")
    # Its sessions as a worker's own (runtime/sessions.py): no statement waits long on a lock, a
    # database gone from the network is noticed within seconds, no idle_session_timeout.
    lock_waits = locks.LockWaits(relay.jobs.db, f"pgjobs relay {os.getpid()}")
    lock_waits.limit_this_thread()
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
        lock_waits.stop()
        connections.close_all()  # this thread's


def relay_chore(bridge: Bridge | None = None) -> RelayChore:
    """The relay of every NATS queue's outbox, as a chore (runjobs) or alone (relayjobs); on a
    connection of its own without `bridge`."""
    bridge = bridge or Bridge(nats_servers())
    jobs = Job.objects.db_manager(router.db_for_write(Job))
    return RelayChore(Relay(jobs, bridge, nats_queues(), bridge.servers.relay_batch))


def start_relay(relay: Relay) -> None:
    """Relay on a daemon thread until the process exits; at exit, its round in progress may
    finish (a round cut short is rolled back and done again by the next relay)."""
    stopped = threading.Event()
    thread = threading.Thread(
        target=relay_until, args=(relay, stopped), name="pgjobs-relay", daemon=True
    )
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(relay.bridge.servers.publish_timeout + 1)

    atexit.register(stop)


def relay_alone(stopped: threading.Event, once: bool = False) -> int:
    """`relayjobs`: relay on this thread until `stopped` (or, with `once`, until the outbox is
    drained); returns how many jobs it relayed."""
    relay = relay_chore().relay
    try:
        relay_until(relay, stopped, once)
    finally:
        relay.bridge.close()
    return relay.relayed
