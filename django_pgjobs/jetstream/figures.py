"""The figures of the NATS queues' streams and consumers, for the health report. Reads only:
the report never creates a stream or a consumer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from nats.js.errors import NotFoundError

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.observability.stats import StreamStats
from django_pgjobs.transports import NatsQueue, nats_servers

#: Seconds the report waits for the server before it says it is unreachable.
REPORT_TIMEOUT = 2.0


def measure(queues: Mapping[str, NatsQueue]) -> list[StreamStats]:
    """Each queue's stream and consumer as the server reports them; unreachable (with the
    error) when it cannot be asked."""
    servers = replace(
        nats_servers(), connect_timeout=REPORT_TIMEOUT, publish_timeout=REPORT_TIMEOUT
    )
    bridge = Bridge(servers)
    try:
        return [_measure(bridge, queue) for queue in queues.values()]
    finally:
        bridge.close()


def _measure(bridge: Bridge, queue: NatsQueue) -> StreamStats:
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
    return replace(
        found,
        pending=consumer.num_pending or 0,
        ack_pending=consumer.num_ack_pending or 0,
        redelivered=consumer.num_redelivered or 0,
    )
