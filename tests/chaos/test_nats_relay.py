"""Scenario: a queue carried by NATS JetStream, its relay SIGKILLed every two seconds and the
NATS server restarted once, while jobs are enqueued (some in transactions that roll back).
The handlers' ledger proves no job lost, none rolled back ever run, and duplicates only where
the documentation promises them: a delivery whose acknowledgement was lost, delivered again."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from tests import tasks
from tests.chaos.nats_server import NatsServer
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess
from tests.models import ChaosExecution

nats = pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")

from django_pgjobs import transports  # noqa: E402
from django_pgjobs.jetstream.bridge import Bridge  # noqa: E402
from django_pgjobs.models import DeadLetter, Job  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)

CONCURRENCY = 4
WORKERS = 2


class RolledBack(Exception):
    pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    started = NatsServer(tmp_path / "nats")
    started.start()
    yield started
    started.stop()


def test_relay_killed_every_two_seconds_and_nats_restarted_loses_no_job(
    settings: Any, server: NatsServer, tmp_path: Path, size: Any
) -> None:
    jobs, per_batch = size(2_000, 10_000), 50
    queue = f"pgjobschaos_{uuid.uuid4().hex[:10]}"
    queues = {queue: {"TRANSPORT": "nats", "MAX_AGE": 3600, "DUPLICATE_WINDOW": 120}}
    servers = {"SERVERS": server.url, "PUBLISH_TIMEOUT": 2, "RELAY_BATCH": 50}
    settings.PGJOBS = {**settings.PGJOBS, "QUEUES": queues, "NATS": servers}
    env = {
        "PGJOBS_TEST_QUEUES": json.dumps(queues),
        "PGJOBS_TEST_NATS_SETTINGS": json.dumps(servers),
    }
    logs: list[WorkerProcess] = []

    def start(command: str, *args: str) -> WorkerProcess:
        process = WorkerProcess(
            list(args), tmp_path / f"{command}-{len(logs)}.log", env=env, command=command
        )
        logs.append(process)
        return process

    consumers = [
        start("runjobs", "--queue", queue, "--no-relay", "--concurrency", str(CONCURRENCY),
              "--lease", "5", "--poll-interval", "0.5", "--grace", "5")
        for _ in range(WORKERS)
    ]  # fmt: skip
    relay = start("relayjobs")
    committed: list[uuid.UUID] = []
    rolled_back: list[uuid.UUID] = []
    kills, restarted, next_kill = 0, False, time.monotonic() + 2
    rng = random.Random(18)

    def fault() -> None:
        nonlocal relay, kills, next_kill
        if time.monotonic() >= next_kill:
            relay.kill()  # SIGKILL
            kills += 1
            relay = start("relayjobs")
            next_kill = time.monotonic() + rng.uniform(1.5, 2.5)

    try:
        for batch in range(jobs // per_batch):
            payloads = [{"n": batch * per_batch + n} for n in range(per_batch)]
            with transaction.atomic():
                committed += [j.pk for j in Job.objects.bulk_enqueue(tasks.ledger, payloads, queue=queue)]  # fmt: skip  # noqa: E501
            try:
                with transaction.atomic():
                    doomed = tasks.ledger.using(queue=queue).enqueue(n=-1)
                    rolled_back.append(doomed.pk)
                    raise RolledBack
            except RolledBack:
                pass
            if batch == jobs // per_batch // 2 and not restarted:
                server.restart()
                restarted = True
            fault()
            time.sleep(0.15)

        def drained() -> bool:
            fault()
            ran = ChaosExecution.objects.values("job_id").distinct().count()
            outbox = Job.objects.filter(queue=queue, status="ready").count()
            return ran >= jobs and outbox == 0

        wait_until(drained, timeout=size(180, 600), interval=0.5)
    finally:
        for process in [*consumers, relay]:
            process.signal(signal.SIGTERM)
        for process in [*consumers, relay]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(20)
        for process in logs:
            process.kill()
    assert kills >= 3 and restarted

    runs = Counter(ChaosExecution.objects.values_list("job_id", flat=True))
    assert set(runs) == set(committed), "every committed job ran; nothing else did"
    assert not set(rolled_back) & set(runs)
    assert not DeadLetter.objects.filter(queue=queue).exists()

    # The stream holds each job once, however often its relay died around the publish.
    bridge = Bridge(transports.nats_servers())
    try:
        stream = transports.nats_queues()[queue]
        info = bridge.call(bridge.js.stream_info(stream.stream))
        assert info.state.messages == jobs
        audit = bridge.call(
            bridge.js.pull_subscribe(stream.subject, durable="audit", stream=stream.stream)
        )
        ids: Counter[str] = Counter()
        while sum(ids.values()) < jobs:
            batch = bridge.fetch(audit, 500, 2.0)
            assert batch, f"read {sum(ids.values())} of {jobs} messages back"
            ids.update(msg.headers["Nats-Msg-Id"] for msg in batch)
            bridge.settle(batch, [], [])
    finally:
        bridge.close()
    assert {key.split(":")[0] for key in ids} == {str(pk) for pk in committed}
    assert max(ids.values()) == 1

    # A job runs again only when a delivery's acknowledgement was lost (the NATS restart): a
    # later delivery, a higher attempt, never a second run of the same delivery.
    again = {
        job_id: sorted(
            ChaosExecution.objects.filter(job_id=job_id).values_list("attempt", flat=True)
        )
        for job_id, count in runs.items()
        if count > 1
    }
    assert all(len(set(attempts)) == len(attempts) for attempts in again.values()), again
    assert len(again) <= WORKERS * CONCURRENCY * 2, again
    print(f"NATS chaos: {jobs} jobs, {kills} relay kills, 1 NATS restart, {len(again)} re-run")
