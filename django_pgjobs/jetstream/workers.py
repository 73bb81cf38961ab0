"""What `runjobs` runs when a queue uses NATS: a worker on the NATS queues it was given, or on
PostgreSQL queues, each with the relay on a thread of its own (unless --no-relay), so that
publishing never holds up the worker's loop; with --once, the relay is a chore of the loop, so
that the worker's drain includes it."""

from __future__ import annotations

import atexit
import threading

from django.db import router

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.relay import Relay, RelayChore, relay_until
from django_pgjobs.jetstream.source import NatsSource
from django_pgjobs.models import Job
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.options import Options
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.transports import nats_queues, nats_servers


class MixedQueues(ValueError):
    """NATS queues and PostgreSQL queues given to one worker."""


def worker(options: Options) -> Worker:
    """The worker for `options.queues`: with a NATS source when they all use NATS, PostgreSQL
    when none does (MixedQueues otherwise); with the relay of every NATS queue when
    options.relay."""
    queues = nats_queues()
    ours = [queues[name] for name in options.queues if name in queues]
    if ours and len(ours) != len(options.queues):
        others = [name for name in options.queues if name not in queues]
        raise MixedQueues(
            f"the queues {', '.join(q.queue for q in ours)} use NATS and "
            f"{', '.join(others)} PostgreSQL: run one runjobs for each kind"
        )
    bridge = Bridge(nats_servers())
    chores: list[Chore] = []
    if options.relay and options.once:
        chores.append(relay_chore(bridge))
    elif options.relay:
        start_relay(relay_chore(bridge).relay)
    if ours:
        return Worker(options, NatsSource(ours, bridge), chores)
    return Worker(options, chores=chores)


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
