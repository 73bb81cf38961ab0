"""The process's NATS connection, owned by an asyncio loop on a thread of its own, with
blocking methods for the worker's threads (nats-py is asyncio; the worker is not)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Sequence
from enum import Enum
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from django_pgjobs.runtime.reporting import log_safely
from django_pgjobs.transports import NatsServers

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A message to publish: subject, body, headers.
Outgoing = tuple[str, bytes, dict[str, str]]


class Sent(Enum):
    """What became of an acknowledgement sent with Bridge.acknowledge."""

    CONFIRMED = "confirmed"  # the server processed it
    UNSENT = "unsent"  # it never left: not connected, or too late to send (see `until`)
    UNCERTAIN = "uncertain"  # sent, but no confirmation came: processed or lost, unknown


class Bridge:
    """One NATS connection and its JetStream context. Every method blocks its caller and may
    be called from any thread; each raises what nats-py raises (a timeout, no servers)."""

    def __init__(self, servers: NatsServers) -> None:
        self.servers = servers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pgjobs-nats", daemon=True
        )
        self._thread.start()
        self._client: Client | None = None
        self._connecting = threading.Lock()
        self._closing = False
        #: The last error nats-py reported (a refused connection, a permissions violation).
        self.last_error = ""

    def call(self, coroutine: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coroutine` on the bridge's loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(_wrap(coroutine), self._loop)
        wait = None if timeout is None else timeout + 1.0  # the coroutine's own timeout first
        return future.result(wait)

    @property
    def client(self) -> Client:
        """The connection; a new one when nats-py closed the last for good (it does so on any
        error the server sends but a permissions violation: a message over max_payload, say),
        unless the bridge itself was closed."""
        with self._connecting:
            if self._client is not None and self._client.is_closed and not self._closing:
                log_safely(
                    logger.warning,
                    "NATS: the connection was closed after an error (%s); connecting again",
                    self._client.last_error or "no error said",
                )  # fmt: skip
                self._client = None
            if self._client is None:
                self._client = self.call(self._connect(), self.servers.connect_timeout * 2)
            return self._client

    @property
    def js(self) -> JetStreamContext:
        return self.client.jetstream(timeout=self.servers.publish_timeout)

    def publish(self, messages: Sequence[Outgoing]) -> None:
        """Publish every message and wait until the stream acknowledged each one; raises the
        first error (then some may have been stored: their ids make a new try harmless)."""
        for outcome in self.publish_each(messages):
            if outcome is not None:
                raise outcome

    def publish_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish every message at once and wait for the stream's acknowledgements; returns,
        for each in order, None when the stream acknowledged it (stored, or a duplicate of
        its message id) or the error that came instead (it may have been stored all the
        same: only its message id makes a second publish harmless)."""
        js, timeout = self.js, self.servers.publish_timeout

        async def publish_all() -> list[Exception | None]:
            sent = [
                js.publish(subject, body, timeout=timeout, headers=headers)
                for subject, body, headers in messages
            ]
            outcomes = await asyncio.gather(*sent, return_exceptions=True)
            for outcome in outcomes:  # a cancellation or an interrupt is not a refusal
                if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome
            return [outcome if isinstance(outcome, Exception) else None for outcome in outcomes]

        return self.call(publish_all(), timeout)

    def fetch(self, subscription: Any, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages of a pull subscription, waiting up to `timeout` for the
        first; none when none came."""

        async def fetch() -> list[Msg]:
            client = self._client  # on the loop: the `client` property would wait for the loop
            if client is not None and client.is_closed and not self._closing:
                # For good: the subscription is the closed connection's. The caller makes it
                # again on a new one (the `client` property).
                raise nats.errors.ConnectionClosedError
            if client is None or not client.is_connected:  # a pull request would only fail
                await asyncio.sleep(timeout)
                return []
            try:
                return list(await subscription.fetch(batch, timeout=timeout))
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.OutboundBufferLimitError):
                return []

        return self.call(fetch(), timeout + self.servers.publish_timeout)

    def settle(self, acks: Sequence[Msg], naks: Sequence[tuple[Msg, float]],
               terms: Sequence[Msg]) -> None:  # fmt: skip
        """Acknowledge, negatively acknowledge with a delay (seconds), or terminate messages."""

        async def settle() -> None:
            sent = [msg.ack() for msg in acks]
            sent += [msg.nak(delay=delay) for msg, delay in naks]
            sent += [msg.term() for msg in terms]
            await asyncio.gather(*sent)

        self.call(settle(), self.servers.publish_timeout)

    def acknowledge(self, answers: Sequence[tuple[Msg, bytes, float]]) -> list[Sent]:
        """Send each message's acknowledgement (`+ACK`, `-NAK ...`, `+TERM`, `+WPI`) unless
        the monotonic clock is past its `until` when it would leave; returns what became of
        each, in order. Each is a request, so that the server says it processed it (a
        fire-and-forget one on a broken connection is lost without a word).

        The server processes an acknowledgement of any delivery of a message it still holds
        unacknowledged, whichever delivery's reply subject carries it (nats-server's
        consumer.go: processNak, progressUpdate and processAckMsg find the message by its
        stream sequence, never by its delivery count), so an acknowledgement must not leave
        late: `until` is looked at on the connection's own loop, just before it is written."""

        async def send_all() -> list[Sent]:
            return list(await asyncio.gather(*(self._acknowledge(*answer) for answer in answers)))

        return self.call(send_all(), self.servers.publish_timeout)

    def in_progress(self, messages: Sequence[tuple[Msg, float]]) -> list[float | None]:
        """Tell the server these messages' handlers still run (their ack wait starts again),
        each unless the monotonic clock is past its `until` (as `acknowledge`); returns, for
        each, when the server's confirmation came back (monotonic), or None."""

        async def touch(msg: Msg, until: float) -> float | None:
            sent = await self._acknowledge(msg, b"+WPI", until)
            return time.monotonic() if sent is Sent.CONFIRMED else None

        async def touch_all() -> list[float | None]:
            return list(await asyncio.gather(*(touch(*pair) for pair in messages)))

        return self.call(touch_all(), self.servers.publish_timeout)

    async def _acknowledge(self, msg: Msg, payload: bytes, until: float) -> Sent:
        client = self._client  # on the loop: the `client` property would wait for the loop
        if client is None or not client.is_connected or time.monotonic() >= until:
            return Sent.UNSENT
        try:
            await client.request(msg.reply, payload, timeout=self.servers.publish_timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return Sent.UNCERTAIN
        except nats.errors.Error:
            # Not connected (nothing is kept to be sent later: see _connect), or no consumer
            # took it (the server still recovering its streams): not processed.
            return Sent.UNSENT
        return Sent.CONFIRMED

    @property
    def closed(self) -> bool:
        """Whether close() was called: nothing can be sent any more."""
        return self._closing

    def close(self) -> None:
        """Close the connection and stop the loop (once; later calls do nothing)."""
        if self._closing:
            return
        self._closing = True
        if self._client is not None and not self._client.is_closed:
            try:
                self.call(self._client.close(), self.servers.publish_timeout)
            except Exception as error:  # closing: say so, never raise
                logger.warning("NATS connection did not close cleanly: %r", error)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _connect(self) -> Client:
        """Connect, giving up after twice the connect timeout (nats-py alone would try the
        first connection forever); once connected, the client reconnects by itself."""
        said: dict[str, float] = {}

        async def error(exc: Exception) -> None:
            # Once per kind of error and half-minute: an outage retries every half second.
            text = f"{type(exc).__name__}: {exc}"
            self.last_error = text
            if time.monotonic() - said.get(text, -60.0) >= 30.0:
                said[text] = time.monotonic()
                logger.warning("NATS: %s", text)

        async def disconnected() -> None:
            if not self._closing:
                logger.warning("NATS: disconnected; reconnecting")

        async def reconnected() -> None:
            logger.info("NATS: reconnected")

        # pending_size 0: what is sent while the connection is down fails at once instead of
        # waiting in nats-py's buffer to be written after the reconnection, perhaps minutes
        # later: an acknowledgement (or a pull request) must reach the server while it still
        # means what it meant, or not at all (the worker then knows, and decides again).
        options = {**self.servers.options, "pending_size": 0}
        connecting = nats.connect(
            **options,
            servers=list(self.servers.servers),
            connect_timeout=self.servers.connect_timeout,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
        )
        return await asyncio.wait_for(connecting, self.servers.connect_timeout * 2)


async def _wrap(awaitable: Awaitable[T]) -> T:
    return await awaitable
