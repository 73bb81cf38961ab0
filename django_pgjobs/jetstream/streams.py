"""Each NATS queue's stream and durable consumer: created (or updated) from its settings, made
again from where it had got, bound at the worker's fetch, read once a second by the
acknowledgement thread, and measured for the health report (their figures)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone
from nats.js import api
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError

from django_pgjobs.jetstream.bridge import Bridge
from django_pgjobs.jetstream.messages import due_at
from django_pgjobs.models import Queue
from django_pgjobs.observability.stats import StreamStats
from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.transports import NatsQueue, nats_servers


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


logger = logging.getLogger("django_pgjobs.jetstream.consumer")

#: The server's error code for a stream that does not exist (a consumer's is 10014).
STREAM_NOT_FOUND = 10059

#: Seconds before a worker started within which a stream made counts as new (made by a relay
#: started with it, give or take the clocks): a consumer of this worker's queue that was deleted
#: before it started cannot have run any of its messages.
NEW_STREAM = 60.0


class Consumers:
    """The consumers of `queues` for worker `worker` (its --lease `lease`, its database `db`):
    `subscription(queue)` from the main loop, `read(last)` from the acknowledgement thread
    (`stopping()`: the worker is stopping)."""

    def __init__(
        self,
        worker: str,
        bridge: Bridge,
        queues: Sequence[NatsQueue],
        lease: float,
        db: str,
        stopping: Callable[[], bool],
    ) -> None:
        self.worker, self.bridge, self.queues = worker, bridge, list(queues)
        self.lease, self.db, self.stopping = lease, db, stopping
        self._subscriptions: dict[str, object] = {}
        self._gone: set[str] = set()  # queues whose consumer was found gone (read)
        self._ack_floors: dict[str, int] = {}  # by queue: its consumer's, as last read
        # By queue: its consumer's messages not yet delivered, and delivered and unacknowledged,
        # as last read (what a stream gone took with it).
        self._pending: dict[str, tuple[int, int]] = {}
        self._streams_made: dict[str, Any] = {}  # by queue: when its stream was created
        self._loss_said: set[str] = set()  # queues whose stream was said gone (read)
        self._started = timezone.now()

    def subscription(self, queue: NatsQueue) -> object:
        """The queue's pull subscription, its stream and consumer made (again) if need be."""
        if queue.queue in self._gone:  # a pull from a consumer gone only times out
            self._gone.discard(queue.queue)
            self._subscriptions.pop(queue.queue, None)  # made and bound again here
        subscription = self._subscriptions.get(queue.queue)
        if subscription is None:
            stream = ensure_stream(self.bridge, queue)
            floor = self._ack_floors.get(queue.queue)
            said = queue.queue in self._loss_said
            self._loss_said.discard(queue.queue)
            if self._streams_made.setdefault(queue.queue, stream.created) != stream.created:
                # The stream itself was made again (deleted, or the server lost its storage):
                # its sequences start again, and the old floor would pass over its messages.
                self._streams_made[queue.queue], floor = stream.created, None
                self._ack_floors.pop(queue.queue, None)
                if not said:
                    self._say_stream_lost(queue, "was made again")
                self._pending.pop(queue.queue, None)
            subscription, made = ensure_consumer(
                self.bridge, queue, self.lease, self._max_ack_pending(queue), resume_after=floor
            )
            if made is not None:
                self._say_made(queue, stream, floor)
            self._subscriptions[queue.queue] = subscription
        return subscription

    def forget(self) -> None:
        """The stream or a consumer was deleted, or the connection closed for good
        (Bridge.client): every subscription is made and bound again at the next fetch."""
        self._subscriptions.clear()

    def read(self, last: float) -> float:
        """Read the consumers as the server has them now; returns the shortest ack wait (`last`,
        the one read before, while the worker stops). They are shared: a worker of the queue
        started with a shorter --lease sets its own (this one's in-progress acknowledgements
        must then come as often, or every message it runs is delivered again to another worker
        while it runs). One found gone (deleted by hand, or the server restarted without its
        storage, which its pulls cannot tell from an empty queue) is made again at the main
        loop's next fetch, from just after its last acknowledgements in order."""
        waits = [self.lease]
        if self.stopping():  # its grace: the last ack wait read stands
            return last
        for queue in self.queues:
            if queue.queue not in self._subscriptions or queue.queue in self._gone:
                continue
            try:
                info = self.bridge.call(
                    self.bridge.js.consumer_info(queue.stream, queue.consumer),
                    self.bridge.servers.publish_timeout,
                )
            except NotFoundError as error:
                self._gone.add(queue.queue)
                if error.err_code == STREAM_NOT_FOUND:
                    self._loss_said.add(queue.queue)
                    self._say_stream_lost(queue, "is gone")
                    continue
                log_safely(
                    logger.warning,
                    "worker %s: the consumer %s of queue %r is gone (deleted, or the server "
                    "lost its storage); making it again", self.worker, queue.consumer, queue.queue,
                )  # fmt: skip
                continue
            self._ack_floors[queue.queue] = max(  # where one made again starts (subscription)
                self._ack_floors.get(queue.queue, 0), ack_floor(info)
            )
            self._pending[queue.queue] = (info.num_pending or 0, info.num_ack_pending or 0)
            waits.append(float(info.config.ack_wait or self.lease))
        shortest = min(waits)
        if shortest < self.lease and shortest != last:
            log_safely(
                logger.warning,
                "worker %s: a consumer of its queues has an ack wait of %gs, under its lease of "
                "%gs (set by a worker started with a shorter --lease): in-progress "
                "acknowledgements every %.2gs", self.worker, shortest, self.lease, shortest / 3,
            )  # fmt: skip
        return shortest

    def _say_stream_lost(self, queue: NatsQueue, what: str) -> None:
        """Say that the queue's stream `what` ("is gone", "was made again"), and how many
        messages its consumer had pending as last read: they went with it."""
        pending = self._pending.pop(queue.queue, None)
        if pending is None:
            held = "how many is unknown: the worker had not read its consumer yet"
        else:
            waiting, delivered = pending
            held = f"{waiting + delivered} were pending as its consumer was last read: "
            held += f"{waiting} not yet delivered, which never run, and {delivered} delivered "
            held += "and not acknowledged, which are not retried"
        log_safely(
            logger.warning,
            "worker %s: the stream %s of queue %r %s (deleted, or the server lost its "
            "storage); every message it held is lost with it (%s). Jobs relayed from now on go "
            "to the stream made again (docs/explanation/graduating.md)",
            self.worker, queue.stream, queue.queue, what, held,
        )  # fmt: skip

    def _say_made(self, queue: NatsQueue, stream: Any, floor: int | None) -> None:
        """Say that the queue's consumer had to be made, and which messages it delivers."""
        state = stream.state
        if floor is None and state.messages and self._new(stream):
            # A first start (jobs relayed before any worker took them), or a stream made again:
            # none of its messages has run.
            log_safely(
                logger.info,
                "worker %s: made the consumer %s of queue %r on its new stream %s: it delivers "
                "the %d messages relayed so far (sequences %d to %d)",
                self.worker, queue.consumer, queue.queue, queue.stream, state.messages,
                state.first_seq, state.last_seq,
            )  # fmt: skip
        elif floor is not None:
            log_safely(
                logger.warning,
                "worker %s: made the consumer %s of queue %r again, delivering from stream "
                "sequence %d on (after the last one it had acknowledged in order, as this "
                "worker last read it): a job acknowledged after that runs again",
                self.worker, queue.consumer, queue.queue, floor + 1,
            )  # fmt: skip
        elif state.messages and queue.retention != "workqueue":  # there, none ran: all due
            log_safely(
                logger.warning,
                "worker %s: the consumer %s of queue %r did not exist: made, it delivers every "
                "message the stream %s holds (%d, sequences %d to %d). If the queue ran on "
                "NATS before and its consumer was deleted, the jobs among them that ran run "
                "again (docs/explanation/graduating.md)",
                self.worker, queue.consumer, queue.queue, queue.stream, state.messages,
                state.first_seq, state.last_seq,
            )  # fmt: skip

    def _new(self, stream: Any) -> bool:
        """Whether `stream` was made since this worker started (NEW_STREAM aside)."""
        made = stream.created
        return made is not None and made >= self._started - timedelta(seconds=NEW_STREAM)

    def _max_ack_pending(self, queue: NatsQueue) -> int:
        """The queue's max_running (a Queue row) when set: across every worker, as many
        messages as that may be delivered and unacknowledged at once."""
        limit = Queue.objects.using(self.db).filter(name=queue.queue).values_list(
            "max_running", flat=True
        ).first()  # fmt: skip
        return queue.max_ack_pending if limit is None else max(limit, 1)


def ack_floor(info: Any) -> int:
    """The stream sequence up to which consumer `info` has acknowledged every message. The
    server says 0 for a consumer made to start at a sequence (made again, by subscription)
    until its first acknowledgement: then the one before its start. Taken as 0, it had a
    consumer deleted again before that made again from the stream's first message, and every
    job the stream held ran again."""
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    if info.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE:
        floor = max(floor, (info.config.opt_start_seq or 1) - 1)
    return int(floor)


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
