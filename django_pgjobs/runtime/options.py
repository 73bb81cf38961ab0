"""A worker's options, its id, and the exit codes that say how it ended."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


def worker_id() -> str:
    """Unique per process: host, pid and a random suffix (pids are reused, hosts are cloned)."""
    return f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class Options:
    queues: Sequence[str] = ("default",)
    concurrency: int = 10
    batch_size: int = 100
    lease: float | None = None  # default PGJOBS["LEASE"]
    grace: float = 30.0
    poll_interval: float = 2.0
    listen: bool = True
    once: bool = False
    reap_interval: float = 5.0
    promote_interval: float = 1.0  # how often due scheduled jobs join the claim index
    prune_interval: float = 60.0
    stats_interval: float = 10.0
    controls_interval: float = 1.0  # how often the Queue controls (pause, limits) are read
    worker_id: str | None = None  # given by a supervisor (runjobs --processes); else made up
    max_jobs: int | None = None  # recycle after recording this many outcomes
    max_memory_mb: float | None = None  # recycle when resident memory passes this
    parent_pid: int | None = None  # a supervisor's: stop when it is gone
    relay: bool = True  # publish the outbox of NATS queues (transports.py), if there are any


class Exit(IntEnum):
    """How a worker ended: its process's exit code."""

    OK = 0  # stopped or drained, every job it held recorded or released
    UNRELEASED = 1  # stopped, but jobs it held could not be released (their leases expire)
    RECYCLE = 75  # stopped gracefully to be replaced: a limit of --max-jobs/--max-memory, or
    # abandoned handler threads piled up (runtime/timeouts.py)
