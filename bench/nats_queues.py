"""NATS JetStream queues: the relay's throughput (outbox rows to the stream, jobs/s) and a drain
through JetStream beside the PostgreSQL drain, each with its statements per job on PostgreSQL.

The NATS server is $BENCH_NATS (default nats://127.0.0.1:4222); the stream is named after a
queue unique to the run and deleted afterwards."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.test.utils import override_settings

from bench.ceiling import reset
from bench.cluster import Cluster
from bench.workloads import NOOP, counters, reap_child, reset_stats, start_worker
from django_pgjobs.models import Job

QUEUE = f"bench_nats_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Figures:
    jobs_per_second: float
    statements: float  # per job, on PostgreSQL
    commits: float  # per job


def _settings(url: str) -> dict[str, object]:
    return {
        "QUEUES": {QUEUE: {"TRANSPORT": "nats", "MAX_AGE": 3600}},
        "NATS": {"SERVERS": url, "RELAY_BATCH": 500},
    }


@contextmanager
def nats_queue(url: str) -> Iterator[dict[str, str]]:
    """PGJOBS with the run's NATS queue, here and (through the returned environment) in the
    workers; the stream is deleted at the end."""
    settings = _settings(url)
    with override_settings(PGJOBS={**settings}):
        try:
            yield {"BENCH_PGJOBS_NATS": json.dumps(settings)}
        finally:
            from django_pgjobs import transports
            from django_pgjobs.jetstream.bridge import Bridge

            bridge = Bridge(transports.nats_servers())
            with contextlib.suppress(Exception):  # never made: nothing to delete
                bridge.call(bridge.js.delete_stream(transports.nats_queues()[QUEUE].stream))
            bridge.close()


def relay_throughput(cluster: Cluster, count: int) -> Figures:
    """Time relay rounds (in this process) moving `count` committed outbox rows to the stream."""
    from django_pgjobs.jetstream.relay import relay_chore

    reset(cluster)
    Job.objects.bulk_enqueue(NOOP, (None for _ in range(count)), queue=QUEUE)
    chore = relay_chore()
    chore.relay.round()  # the stream is made, and the connections are up, before the clock starts
    reset_stats(cluster)
    before = counters(cluster)
    started = time.perf_counter()
    relayed = 0
    while (done := chore.relay.round()) or not relayed:
        relayed += done
    seconds = time.perf_counter() - started
    after = counters(cluster)
    chore.relay.bridge.close()
    total = relayed + chore.relay.batch  # the first round's rows were relayed before the clock
    assert total >= count, f"relayed {total} of {count}"
    return Figures(
        relayed / seconds,
        (after.statements - before.statements) / relayed,
        (after.commits - before.commits) / relayed,
    )


def drain(cluster: Cluster, count: int, env: dict[str, str], logs: Path) -> Figures:
    """Enqueue `count` jobs to the NATS queue, then time one `runjobs --queue <it> --once`
    relaying and running them all (end to end: outbox → stream → handler → ack)."""
    reset(cluster)
    Job.objects.bulk_enqueue(NOOP, (None for _ in range(count)), queue=QUEUE)
    reset_stats(cluster)
    before = counters(cluster)
    started = time.perf_counter()
    worker = start_worker(cluster, ["--queue", QUEUE, "--once"], logs / "nats-drain.log", **env)
    reap_child(worker)
    seconds = time.perf_counter() - started
    after = counters(cluster)
    left = Job.objects.filter(queue=QUEUE).count()
    if left:
        raise RuntimeError(f"{left} of {count} jobs still in the outbox after the drain")
    return Figures(
        count / seconds,
        (after.statements - before.statements) / count,
        (after.commits - before.commits) / count,
    )
