"""A nats-server of the test's own, with JetStream, on a free port and a store in a temporary
folder: the tests that stop or restart NATS never touch the machine's server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARY = shutil.which("nats-server") or "/usr/sbin/nats-server"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class NatsServer:
    """Started with start(), stopped with stop(); restart() keeps its port and its store."""

    def __init__(self, folder: Path, config: str = "") -> None:
        """`config`: the server's configuration file's text beyond its port and store (users
        and their permissions, say)."""
        if not Path(BINARY).exists():
            pytest.fail(f"these tests need nats-server ({BINARY} is missing): .ci/run installs it")
        self.folder = folder
        self.port = free_port()
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        arguments = ["-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.folder)]
        if self.config:
            (self.folder / "server.conf").write_text(self.config)
            arguments += ["-c", str(self.folder / "server.conf")]
        with (self.folder / "server.log").open("ab") as log:  # the server keeps its own copy
            self.process = subprocess.Popen(
                [BINARY, *arguments], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nats-server did not listen on {self.port} within 10s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def restart(self, down: float = 1.0) -> None:
        self.stop()
        time.sleep(down)  # the clients notice, and their acknowledgements fail meanwhile
        self.start()
