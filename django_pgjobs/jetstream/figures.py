"""The figures of the NATS queues' streams and consumers, for the health report. Reads only:
the report never creates a stream or a consumer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from nats.js.errors import NotFoundError

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.messages import due_at
from django_pgjobs.observability.stats import StreamStats
from django_pgjobs.transports import NatsQueue, nats_servers

#: Seconds the report waits for the server before it says it is unreachable.
REPORT_TIMEOUT = 2.0


def measure(queues: Mapping[str, NatsQueue], now: datetime) -> list[StreamStats]:
    """Each queue's stream and consumer as the server reports them; unreachable (with the
    error) when it cannot be asked. `now` is the database's clock (oldest_pending_seconds)."""
    servers = replace(
        nats_servers(), connect_timeout=REPORT_TIMEOUT, publish_timeout=REPORT_TIMEOUT
    )
    bridge = Bridge(servers)
    try:
        return [_measure(bridge, queue, now) for queue in queues.values()]
    finally:
        bridge.close()


def _measure(bridge: Bridge, queue: NatsQueue, now: datetime) -> StreamStats:
    found = StreamStats(queue.queue, queue.stream, queue.consumer, reachable=True)
    try:
        js = bridge.js
        stream = bridge.call(js.stream_info(queue.stream), REPORT_TIMEOUT)
        found = replace(found, messages=stream.state.messages)
        consumer = bridge.call(js.consumer_info(queue.stream, queue.consumer), REPORT_TIMEOUT)
    except NotFoundError:
        return found  # not created yet: no worker or relay has started
    except Exception as error:
        return replace(found, reachable=False, error=f"{type(error).__name__}: {error}".strip())
    found = replace(
        found,
        pending=consumer.num_pending or 0,
        ack_pending=consumer.num_ack_pending or 0,
        redelivered=consumer.num_redelivered or 0,
    )
    if not found.pending or consumer.delivered is None:
        return found
    due = _oldest_pending_due(bridge, queue, consumer.delivered.stream_seq + 1)
    if due is None:
        return found
    return replace(found, oldest_pending_seconds=max(0.0, (now - due).total_seconds()))


def _oldest_pending_due(bridge: Bridge, queue: NatsQueue, after: int) -> datetime | None:
    """When the job of the consumer's next message (the first of its subject from stream
    sequence `after` on) was due; None if there is none, or it cannot be read: the report
    then judges without its age."""
    try:
        message = bridge.call(
            bridge.js.get_msg(queue.stream, seq=after, subject=queue.subject, next=True),
            REPORT_TIMEOUT,
        )
        return due_at(message.data)
    except Exception:  # gone since (its stream's limits), the server is slow, a bug: no age
        return None
