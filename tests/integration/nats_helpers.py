"""What the NATS tests share: a queue of their own on the NATS server, a relay, a worker in a
thread, and reading a stream back. The server is PGJOBS_TEST_NATS (default the machine's,
nats://127.0.0.1:4222), of the release PGJOBS_TEST_NATS_SERVER names for the servers tests start
themselves (tests/chaos/nats_server.py); every stream, subject and consumer a test makes is named
after a queue unique to that test, and deleted after it."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

nats = pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")

from django_pgjobs import transports  # noqa: E402
from django_pgjobs.jetstream import streams  # noqa: E402
from django_pgjobs.jetstream.bridge import Bridge  # noqa: E402
from django_pgjobs.jetstream.relay import Relay  # noqa: E402
from django_pgjobs.jetstream.source import NatsSource  # noqa: E402
from django_pgjobs.models import Job  # noqa: E402
from django_pgjobs.runtime.lifecycle import Options  # noqa: E402
from django_pgjobs.runtime.worker import Worker  # noqa: E402

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
        make_stream(name)
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


def make_stream(queue: str, tries: int = 5) -> None:
    """Make `queue`'s stream before the test, as its relay would: a test counting what one relay
    round publishes must not meet a busy shared server's passing failure to make a stream
    ("error creating store for stream", a 500). The relay's own way with that failure (the queue
    backs off and is tried again) is tested in test_nats_relay_rounds."""
    maker = bridge()
    for attempt in range(1, tries + 1):
        try:
            streams.ensure_stream(maker, transports.nats_queues()[queue])
            return
        except nats.js.errors.ServerError:
            if attempt == tries:
                raise
            time.sleep(0.2 * attempt)


@pytest.fixture
def queue(settings: Any) -> Iterator[str]:
    """A queue carried by NATS for one test (nats_queue): its name."""
    with nats_queue(settings) as name:
        yield name


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
    """A worker on NATS queue `queue` running in a thread until stopped."""

    def __init__(
        self,
        queue: str,
        concurrency: int = 4,
        lease: float = 30.0,
        poll_interval: float = 0.2,
        stats_interval: float = 1.0,
    ) -> None:
        options = Options(queues=[queue], concurrency=concurrency, lease=lease, grace=5.0,
                          stats_interval=stats_interval, poll_interval=poll_interval)  # fmt: skip
        self.worker = Worker(options, NatsSource([transports.nats_queues()[queue]], bridge()))
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the worker stops within its grace"


class Proxy:
    """A TCP proxy in front of the NATS server, to cut a worker off from it as a dead link
    does: frozen, it carries nothing either way and what the client sends meanwhile is lost
    (the client, writing into its socket, notices nothing); `thaw()` closes the connections
    it froze (the client then reconnects, as after noticing the dead link) and carries again."""

    def __init__(self) -> None:
        host, port = NATS_URL.rsplit("/", 1)[-1].rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self._listener.getsockname()[1]}"
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        with self._lock:
            cut, self._open = self._open, []
            self._frozen.clear()
        for sock in cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.thaw()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            with self._lock:
                self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    break
                if not self._frozen.is_set():
                    sink.sendall(data)
            except OSError:
                break
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def nats_proxy() -> Iterator[Proxy]:
    """A Proxy; ask for it before the test's queue, so that it outlives the queue's cleanup."""
    proxy = Proxy()
    try:
        yield proxy
    finally:
        proxy.close()


def direct_bridge() -> Bridge:
    """A bridge straight to the NATS server, whatever the settings say (a proxy)."""
    opened = Bridge(transports.NatsServers(servers=(NATS_URL,)))
    _bridges.append(opened)
    return opened


def consumer_info(reader: Bridge, queue: str) -> Any:
    """The queue's consumer as the server has it (None: there is none)."""
    stream = transports.nats_queues()[queue]
    try:
        return reader.call(reader.js.consumer_info(stream.stream, stream.consumer))
    except nats.js.errors.NotFoundError:
        return None
