"""What `runjobs` runs when a queue uses NATS: a worker for the NATS queues it was given, or a
PostgreSQL worker, each with the relay as a chore (unless --no-relay)."""

from __future__ import annotations

from django.db import router

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.consumer import NatsWorker
from django_pgjobs.jetstream.relay import Relay, RelayChore
from django_pgjobs.models import Job
from django_pgjobs.runtime.chores import Chore
from django_pgjobs.runtime.options import Options
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.transports import nats_queues, nats_servers


class MixedQueues(ValueError):
    """NATS queues and PostgreSQL queues given to one worker."""


def worker(options: Options) -> Worker | NatsWorker:
    """The worker for `options.queues`: a NatsWorker when they all use NATS, a Worker when
    none does (MixedQueues otherwise); with the relay of every NATS queue when options.relay."""
    queues = nats_queues()
    ours = [queues[name] for name in options.queues if name in queues]
    if ours and len(ours) != len(options.queues):
        others = [name for name in options.queues if name not in queues]
        raise MixedQueues(
            f"the queues {', '.join(q.queue for q in ours)} use NATS and "
            f"{', '.join(others)} PostgreSQL: run one runjobs for each kind"
        )
    bridge = Bridge(nats_servers())
    chores: list[Chore] = [relay_chore(bridge)] if options.relay else []
    if ours:
        return NatsWorker(options, ours, bridge, chores)
    return Worker(options, chores)


def relay_chore(bridge: Bridge | None = None) -> RelayChore:
    """The relay of every NATS queue's outbox, as a chore (runjobs) or alone (relayjobs); on a
    connection of its own without `bridge`."""
    bridge = bridge or Bridge(nats_servers())
    jobs = Job.objects.db_manager(router.db_for_write(Job))
    return RelayChore(Relay(jobs, bridge, nats_queues(), bridge.servers.relay_batch))
