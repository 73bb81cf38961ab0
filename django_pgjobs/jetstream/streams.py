"""Each NATS queue's stream and durable consumer, created (or updated) from its settings."""

from __future__ import annotations

from typing import Any

from nats.js import api
from nats.js.errors import NotFoundError

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.transports import NatsQueue


def stream_config(queue: NatsQueue) -> api.StreamConfig:
    return api.StreamConfig(
        name=queue.stream,
        subjects=[queue.subject],
        retention=api.RetentionPolicy(queue.retention),
        max_age=queue.max_age or None,
        duplicate_window=queue.duplicate_window,
        num_replicas=queue.replicas,
        storage=api.StorageType.FILE,
    )


def consumer_config(queue: NatsQueue, ack_wait: float, max_ack_pending: int) -> api.ConsumerConfig:
    """The queue's durable pull consumer: every worker of the queue shares it, so each message
    goes to one of them. Redelivered after `ack_wait` seconds without an acknowledgement (the
    lease; workers send in-progress acknowledgements as heartbeats); never given up by the
    server (max_deliver -1): the worker dead-letters a job by its own attempts."""
    return api.ConsumerConfig(
        durable_name=queue.consumer,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
        filter_subject=queue.subject,
    )


def ensure_stream(bridge: Bridge, queue: NatsQueue) -> None:
    """Create the queue's stream, or bring it to the settings."""
    js, config = bridge.js, stream_config(queue)
    try:
        bridge.call(js.stream_info(queue.stream))
    except NotFoundError:
        bridge.call(js.add_stream(config))
    else:
        bridge.call(js.update_stream(config))


def ensure_consumer(bridge: Bridge, queue: NatsQueue, ack_wait: float, max_ack_pending: int) -> Any:
    """Create or update the queue's durable consumer; returns a pull subscription bound to it."""
    js = bridge.js
    bridge.call(js.add_consumer(queue.stream, consumer_config(queue, ack_wait, max_ack_pending)))
    return bridge.call(js.pull_subscribe_bind(queue.consumer, stream=queue.stream))
