"""The figures of the NATS queues' streams and consumers, for the health report. Reads only:
the report never creates a stream or a consumer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.messages import due_at
from django_pgjobs.observability.stats import StreamStats
from django_pgjobs.transports import NatsQueue, nats_servers

#: Seconds the report waits for the server before it says it is unreachable.
REPORT_TIMEOUT = 2.0


def measure(queues: Mapping[str, NatsQueue], now: datetime) -> list[StreamStats]:
    """Each queue's stream and consumer as the server reports them; unreachable (with the
    error) when it cannot be asked. `now` is the database's clock (oldest_pending_seconds).
    One connection for them all, and a server that does not answer in time is not asked
    again for the queues after: the report (jobstats, the admin, a Prometheus scrape) takes
    a few seconds at most, however many queues NATS carries."""
    servers = replace(
        nats_servers(), connect_timeout=REPORT_TIMEOUT, publish_timeout=REPORT_TIMEOUT
    )
    bridge = Bridge(servers)
    try:
        try:
            bridge.client  # noqa: B018 (connects)
        except Exception as error:
            why = bridge.last_error or _said(error)
            said = f"no connection within {2 * REPORT_TIMEOUT:g}s ({why})"
            return [_unreachable(queue, said) for queue in queues.values()]
        found: list[StreamStats] = []
        for queue in queues.values():
            silent = next((s.error for s in found if s.error.startswith("TimeoutError")), None)
            found.append(_unreachable(queue, silent) if silent else _measure(bridge, queue, now))
        return found
    finally:
        bridge.close()


def _unreachable(queue: NatsQueue, error: str) -> StreamStats:
    return StreamStats(queue.queue, queue.stream, queue.consumer, reachable=False, error=error)


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip().rstrip(":")


def _refused(bridge: Bridge, error: BaseException, api: str) -> str:
    """What a request that failed with `error` ran into: the server's permissions violation
    (the request then times out: nats-py reports the refusal apart), naming the subject to
    allow the report's user, else the error."""
    if "permissions violation" not in bridge.last_error:
        return _said(error)
    return f"{bridge.last_error}; allow the report's NATS user to publish to {api}"


def _measure(bridge: Bridge, queue: NatsQueue, now: datetime) -> StreamStats:
    found = StreamStats(queue.queue, queue.stream, queue.consumer, reachable=True)
    js = bridge.js
    bridge.last_error = ""  # what the server refuses is told per request
    try:
        stream = bridge.call(js.stream_info(queue.stream), REPORT_TIMEOUT)
    except NotFoundError:
        return found  # not created yet: nothing was relayed
    except Exception as error:
        return _unreachable(queue, _refused(bridge, error, f"$JS.API.STREAM.INFO.{queue.stream}"))
    found = replace(found, messages=stream.state.messages)
    try:
        consumer = bridge.call(js.consumer_info(queue.stream, queue.consumer), REPORT_TIMEOUT)
    except NotFoundError:
        # No worker of this queue ever started (its consumer is a worker's to make), while
        # jobs are relayed into its stream: a first worker would take every one of them.
        return _unconsumed(bridge, queue, stream, now, found)
    except Exception as error:
        api = f"$JS.API.CONSUMER.INFO.{queue.stream}.{queue.consumer}"
        return _unreachable(queue, _refused(bridge, error, api))
    found = replace(
        found,
        pending=consumer.num_pending or 0,
        ack_pending=consumer.num_ack_pending or 0,
        redelivered=consumer.num_redelivered or 0,
    )
    if found.ack_pending and consumer.ack_floor is not None:
        # Delivered and not acknowledged: running, or held by a worker that died (they wait
        # for a worker that fetches)
        unacked, unread = _age(bridge, queue, consumer.ack_floor.stream_seq + 1, now)
        found = replace(found, oldest_unacked_seconds=unacked, age_error=unread)
    if not found.pending or consumer.delivered is None:
        return found
    return _aged(bridge, queue, consumer.delivered.stream_seq + 1, now, found)


def _unconsumed(
    bridge: Bridge, queue: NatsQueue, stream: StreamInfo, now: datetime, found: StreamStats
) -> StreamStats:
    """The figures of a queue whose stream holds messages and has no consumer yet: every
    message of its subject is pending."""
    if not stream.state.messages:
        return found
    try:
        ours = bridge.call(
            bridge.js.stream_info(queue.stream, subjects_filter=queue.subject), REPORT_TIMEOUT
        )
    except Exception as error:
        return _unreachable(queue, _said(error))
    pending = sum((ours.state.subjects or {}).values())
    if not pending:
        return found
    return _aged(bridge, queue, stream.state.first_seq, now, replace(found, pending=pending))


def _aged(
    bridge: Bridge, queue: NatsQueue, after: int, now: datetime, found: StreamStats
) -> StreamStats:
    """`found` with the age of its oldest pending message, the consumer's next (see _age). When
    it cannot be read, the report judges without it, and says why (age_error)."""
    seconds, error = _age(bridge, queue, after, now)
    return replace(found, oldest_pending_seconds=seconds, age_error=error or found.age_error)


def _age(bridge: Bridge, queue: NatsQueue, after: int, now: datetime) -> tuple[float | None, str]:
    """How long ago the job of the first message of the queue's subject from stream sequence
    `after` on was due (its run_at), or None and why it is not known ("" when there is none)."""
    try:
        message = bridge.call(
            bridge.js.get_msg(queue.stream, seq=after, subject=queue.subject, next=True),
            REPORT_TIMEOUT,
        )
    except NotFoundError:  # gone since (its stream's limits): none left to wait
        return None, ""
    except Exception as error:  # the server is slow, the report's user may not read it, a bug
        return None, _refused(bridge, error, f"$JS.API.STREAM.MSG.GET.{queue.stream}")
    due = due_at(message.data)
    if due is None:
        return None, "the message is not one of ours"
    return max(0.0, (now - due).total_seconds()), ""
