"""What the NATS tests share: a queue of their own on the NATS server, a relay, a worker in a
thread, and reading a stream back. The server is PGJOBS_TEST_NATS (default the machine's,
nats://127.0.0.1:4222); every stream, subject and consumer a test makes is named after a queue
unique to that test, and deleted after it."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

nats = pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")

from django_pgjobs import transports  # noqa: E402
from django_pgjobs.jetstream.bridge import Bridge  # noqa: E402
from django_pgjobs.jetstream.consumer import NatsWorker  # noqa: E402
from django_pgjobs.jetstream.relay import Relay  # noqa: E402
from django_pgjobs.models import Job  # noqa: E402
from django_pgjobs.runtime.options import Options  # noqa: E402

NATS_URL = os.environ.get("PGJOBS_TEST_NATS", "nats://127.0.0.1:4222")

#: The bridges a test opened, closed when its queue goes.
_bridges: list[Bridge] = []


def bridge() -> Bridge:
    opened = Bridge(transports.nats_servers())
    _bridges.append(opened)
    return opened


def queue_settings(name: str, **extra: Any) -> dict[str, Any]:
    return {name: {"TRANSPORT": "nats", "MAX_AGE": 3600, "DUPLICATE_WINDOW": 60, **extra}}


@contextmanager
def nats_queue(settings: Any, **extra: Any) -> Iterator[str]:
    """A queue carried by NATS for one test; its stream is deleted afterwards."""
    host, port = NATS_URL.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError as error:
        pytest.fail(
            f"the NATS tests need a nats-server with JetStream at {NATS_URL} ({error}): start "
            "one with `nats-server -js`, or set PGJOBS_TEST_NATS (.ci/run starts one)"
        )
    name = f"pgjobstest_{uuid.uuid4().hex[:12]}"
    settings.PGJOBS = {
        **settings.PGJOBS,
        "QUEUES": queue_settings(name, **extra),
        "NATS": {"SERVERS": NATS_URL},
    }
    try:
        yield name
    finally:
        cleaner = bridge()
        try:
            cleaner.call(cleaner.js.delete_stream(transports.nats_queues()[name].stream))
        except nats.js.errors.NotFoundError:
            pass
        finally:
            while _bridges:
                _bridges.pop().close()


def relay(batch: int = 500) -> Relay:
    """A relay of every NATS queue, on the test's connection."""
    return Relay(
        Job.objects,
        bridge(),
        transports.nats_queues(),
        batch,
    )


def stream_messages(queue: str) -> int:
    reader = bridge()
    info = reader.call(reader.js.stream_info(transports.nats_queues()[queue].stream))
    return int(info.state.messages)


class WorkerThread:
    """A NatsWorker for `queue` running in a thread until stopped."""

    def __init__(self, queue: str, concurrency: int = 4, lease: float = 30.0) -> None:
        options = Options(queues=[queue], concurrency=concurrency, lease=lease, grace=5.0,
                          stats_interval=1.0, poll_interval=0.2)  # fmt: skip
        self.worker = NatsWorker(options, [transports.nats_queues()[queue]], bridge(), [])
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self) -> NatsWorker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the worker stops within its grace"
