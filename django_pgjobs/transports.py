"""Which transport carries each queue's jobs: PostgreSQL (the default), or NATS JetStream for the
queues PGJOBS["QUEUES"] moves there. Reading settings only: this module never imports `nats`.

A NATS queue still takes its enqueues as rows of the job table, in the caller's transaction:
outbox entries the relay publishes to the queue's stream, run by workers from a durable
JetStream consumer. See docs/explanation/graduating.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django_pgjobs.conf import budget_problems, get_settings

POSTGRES = "postgres"
NATS = "nats"
TRANSPORTS = (POSTGRES, NATS)

#: The stream retention policies JetStream offers (see docs/explanation/graduating.md).
RETENTIONS = ("limits", "interest", "workqueue")

#: Keys of a queue's entry in PGJOBS["QUEUES"], with the defaults of a NATS queue.
QUEUE_KEYS = frozenset(
    {"TRANSPORT", "STREAM", "SUBJECT", "CONSUMER", "RETENTION", "MAX_AGE",
     "DUPLICATE_WINDOW", "REPLICAS", "MAX_ACK_PENDING", "YIELD_BUDGET"}
)  # fmt: skip
#: Keys of PGJOBS["NATS"].
NATS_KEYS = frozenset({"SERVERS", "CONNECT_TIMEOUT", "PUBLISH_TIMEOUT", "RELAY_BATCH", "OPTIONS"})

DEFAULT_SERVERS = ("nats://127.0.0.1:4222",)
#: Stream and consumer names: no '.', '*', '>', whitespace or path separators.
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_-]")
_SUBJECT = re.compile(r"[A-Za-z0-9_:-]+(\.[A-Za-z0-9_:-]+)*")


@dataclass(frozen=True)
class NatsQueue:
    """A queue carried by NATS JetStream: its stream, subject and durable consumer."""

    queue: str
    stream: str
    subject: str
    consumer: str
    #: "limits" keeps messages after they are acknowledged (other consumers can read them and
    #: history can be replayed) until MAX_AGE; "workqueue" deletes each once acknowledged.
    retention: str = "limits"
    max_age: float = 7 * 86400.0
    #: Seconds within which JetStream drops a second publish with the same Nats-Msg-Id.
    duplicate_window: float = 120.0
    replicas: int = 1
    #: Most messages delivered and not yet acknowledged (a Queue row's max_running overrides it).
    max_ack_pending: int = 1000


@dataclass(frozen=True)
class NatsServers:
    servers: tuple[str, ...] = DEFAULT_SERVERS
    connect_timeout: float = 2.0
    #: Seconds the relay waits for the stream's acknowledgements of one batch.
    publish_timeout: float = 5.0
    #: Outbox rows the relay takes per transaction.
    relay_batch: int = 500
    #: More keyword arguments of nats.connect(), e.g. user_credentials, tls, name.
    options: Mapping[str, Any] = field(default_factory=dict)


def transport_of(queue: str) -> str:
    entry = get_settings().QUEUES.get(queue) or {}
    return str(entry.get("TRANSPORT", POSTGRES))


def nats_queues() -> dict[str, NatsQueue]:
    """The queues whose transport is NATS, by name (settings with problems are left out:
    the system check pgjobs.E040 reports them)."""
    found = {}
    for queue, entry in get_settings().QUEUES.items():
        nats = isinstance(entry, Mapping) and entry.get("TRANSPORT") == NATS
        if nats and not _queue_problems(queue, entry):
            found[queue] = _nats_queue(queue, entry)
    return found


def nats_servers() -> NatsServers:
    entry = get_settings().NATS
    servers = entry.get("SERVERS", DEFAULT_SERVERS)
    return NatsServers(
        servers=(servers,) if isinstance(servers, str) else tuple(servers),
        connect_timeout=float(entry.get("CONNECT_TIMEOUT", 2.0)),
        publish_timeout=float(entry.get("PUBLISH_TIMEOUT", 5.0)),
        relay_batch=int(entry.get("RELAY_BATCH", 500)),
        options=dict(entry.get("OPTIONS", {})),
    )


def _nats_queue(queue: str, entry: Mapping[str, Any]) -> NatsQueue:
    safe = _NOT_IN_NAMES.sub("_", queue)
    return NatsQueue(
        queue=queue,
        stream=entry.get("STREAM", f"PGJOBS_{safe}"),
        subject=entry.get("SUBJECT", f"pgjobs.{safe}"),
        consumer=entry.get("CONSUMER", f"pgjobs_{safe}"),
        retention=entry.get("RETENTION", "limits"),
        max_age=float(entry.get("MAX_AGE", 7 * 86400.0)),
        duplicate_window=float(entry.get("DUPLICATE_WINDOW", 120.0)),
        replicas=int(entry.get("REPLICAS", 1)),
        max_ack_pending=int(entry.get("MAX_ACK_PENDING", 1000)),
    )


def problems() -> list[str]:
    """What is wrong with PGJOBS["QUEUES"] and PGJOBS["NATS"] (system check pgjobs.E040)."""
    settings = get_settings()
    queues: Any = settings.QUEUES  # as the project wrote them: any type
    servers: Any = settings.NATS
    if not isinstance(queues, Mapping):
        return [f"PGJOBS['QUEUES'] must be a dict of queue settings by name, not {queues!r}."]
    found: list[str] = []
    for queue, entry in queues.items():
        if not isinstance(entry, Mapping):
            found.append(f"PGJOBS['QUEUES'][{queue!r}] must be a dict, not {entry!r}.")
        else:
            found += _queue_problems(queue, entry)
    if not isinstance(servers, Mapping):
        return [*found, f"PGJOBS['NATS'] must be a dict, not {servers!r}."]
    found += [
        f"PGJOBS['NATS'] has an unknown key {key!r} (known: {', '.join(sorted(NATS_KEYS))})."
        for key in sorted(set(servers) - NATS_KEYS)
    ]
    listed = servers.get("SERVERS", DEFAULT_SERVERS)
    if isinstance(listed, str):
        listed = [listed]
    if not listed or not all(isinstance(url, str) and "://" in url for url in listed):
        found.append(
            f"PGJOBS['NATS']['SERVERS'] must be a URL or a list of URLs such as "
            f"'nats://127.0.0.1:4222', not {servers.get('SERVERS')!r}."
        )
    for key in ("CONNECT_TIMEOUT", "PUBLISH_TIMEOUT", "RELAY_BATCH"):
        if key in servers and not _positive(servers[key]):
            found.append(f"PGJOBS['NATS'][{key!r}] must be a number greater than 0.")
    if not isinstance(servers.get("OPTIONS", {}), Mapping):
        found.append("PGJOBS['NATS']['OPTIONS'] must be a dict of nats.connect() arguments.")
    return found


def _queue_problems(queue: str, entry: Mapping[str, Any]) -> list[str]:
    where = f"PGJOBS['QUEUES'][{queue!r}]"
    found = [
        f"{where} has an unknown key {key!r} (known: {', '.join(sorted(QUEUE_KEYS))})."
        for key in sorted(set(entry) - QUEUE_KEYS)
    ]
    transport = entry.get("TRANSPORT", POSTGRES)
    if transport not in TRANSPORTS:
        found.append(f"{where}['TRANSPORT'] must be one of {TRANSPORTS}, not {transport!r}.")
    if "YIELD_BUDGET" in entry:
        found += budget_problems(f"{where}['YIELD_BUDGET']", entry["YIELD_BUDGET"])
    if transport != NATS:
        return found
    for key in ("STREAM", "CONSUMER"):
        if key in entry and not (
            isinstance(entry[key], str) and entry[key] and not _NOT_IN_NAMES.search(entry[key])
        ):
            found.append(
                f"{where}[{key!r}] must be letters, digits, '_' or '-', not {entry[key]!r}."
            )
    if "SUBJECT" in entry and not (
        isinstance(entry["SUBJECT"], str) and _SUBJECT.fullmatch(entry["SUBJECT"])
    ):
        found.append(
            f"{where}['SUBJECT'] must be a NATS subject without wildcards, such as "
            f"'pgjobs.events', not {entry['SUBJECT']!r}."
        )
    if entry.get("RETENTION", "limits") not in RETENTIONS:
        found.append(f"{where}['RETENTION'] must be one of {RETENTIONS}.")
    for key in ("DUPLICATE_WINDOW", "REPLICAS", "MAX_ACK_PENDING"):
        if key in entry and not _positive(entry[key]):
            found.append(f"{where}[{key!r}] must be a number greater than 0.")
    if "MAX_AGE" in entry and not (_positive(entry["MAX_AGE"]) or entry["MAX_AGE"] == 0):
        found.append(f"{where}['MAX_AGE'] must be seconds (0 keeps messages until deleted).")
    elif not found:
        queue_ = _nats_queue(queue, entry)
        if queue_.max_age and queue_.max_age < queue_.duplicate_window:
            found.append(
                f"{where}['MAX_AGE'] must be at least its DUPLICATE_WINDOW "
                f"({queue_.duplicate_window:g}s), as JetStream requires."
            )
    return found


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0
