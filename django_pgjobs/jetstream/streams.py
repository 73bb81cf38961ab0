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


def ensure_stream(bridge: Bridge, queue: NatsQueue) -> api.StreamInfo:
    """Create the queue's stream, or bring it to the settings; returns it as the server has it."""
    js, config = bridge.js, stream_config(queue)
    try:
        bridge.call(js.stream_info(queue.stream))
    except NotFoundError:
        return bridge.call(js.add_stream(config))
    return bridge.call(js.update_stream(config))


def ensure_consumer(
    bridge: Bridge,
    queue: NatsQueue,
    ack_wait: float,
    max_ack_pending: int,
    resume_after: int | None = None,
) -> tuple[Any, api.ConsumerConfig | None]:
    """Create or update the queue's durable consumer; returns a pull subscription bound to it,
    and the config it was made with when it had to be made (None: it existed).

    An existing consumer keeps where it started (the server refuses to change it). One made
    starts after stream sequence `resume_after` when given (the last ack floor known of a
    consumer that went away: what it had acknowledged does not run again), else at the
    stream's first message (deliver_policy all)."""
    js, config = bridge.js, consumer_config(queue, ack_wait, max_ack_pending)
    try:
        existing = bridge.call(js.consumer_info(queue.stream, queue.consumer)).config
    except NotFoundError:
        existing = None
    if existing is not None:
        config.deliver_policy = existing.deliver_policy
        config.opt_start_seq = existing.opt_start_seq
        config.opt_start_time = existing.opt_start_time
    elif resume_after is not None:
        config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = resume_after + 1
    bridge.call(js.add_consumer(queue.stream, config))
    subscription = bridge.call(js.pull_subscribe_bind(queue.consumer, stream=queue.stream))
    return subscription, None if existing is not None else config
