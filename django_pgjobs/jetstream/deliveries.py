"""One message as a NATS worker holds it: whether its delivery is still the worker's own, and
the acknowledgement decided for it until the server confirmed it.

JetStream acts on an acknowledgement sent on any delivery's reply subject while it holds the
message unacknowledged, a later delivery's too (see Bridge.acknowledge): a worker whose ack
wait ran out (stopped, cut off from NATS) and whose message went to another worker meanwhile
would, with a NAK, have it delivered a third time while the other still runs it. The server
says nothing of which delivery is current, so the worker keeps a fence of its own, as a lease:
the server holds a delivery for the worker at least `ack_wait` seconds from when the worker
sent the last in-progress acknowledgement the server confirmed (or the pull request that
brought it). Until FENCE of that has passed, the delivery is certainly the worker's, and an
acknowledgement sent then arrives in time; once it has passed, the delivery is lost for good
(a later confirmation may be another delivery's), and the worker sends nothing more for it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from nats.aio.msg import Msg

from django_pgjobs.jetstream.answers import Reply
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Outcome

#: The share of the ack wait after the last confirmed hold within which the worker still
#: answers: the rest is left for the answer's way to the server. In-progress acknowledgements
#: come every third of the ack wait, so a worker that runs and reaches NATS never gets near it.
FENCE = 2 / 3


@dataclass(eq=False)
class Delivery:
    """A fetched message, its job, and what the worker decided to answer (not yet confirmed)."""

    job: Job
    msg: Msg
    #: Monotonic: when the worker sent the last request the server confirmed holding it for
    #: (the fetch, then each in-progress acknowledgement).
    held_at: float
    #: Which delivery of the message this is (DeliveryCounts).
    count: int = 1
    lost: bool = False
    reply: Reply | None = None
    delay: float = 0.0
    #: The attempt's end, with its outcome; None for a message given back unstarted.
    handled: Handled | None = None
    outcome: Outcome | None = None

    def until(self, ack_wait: float) -> float:
        """Until when (monotonic) an acknowledgement of this delivery may be sent."""
        return self.held_at + ack_wait * FENCE

    def ours(self, ack_wait: float) -> bool:
        """Whether the delivery is still the worker's; once not, never again."""
        if not self.lost and time.monotonic() >= self.until(ack_wait):
            self.lost = True
        return not self.lost

    def held(self, sent_at: float, confirmed_at: float, ack_wait: float) -> None:
        """The server confirmed an in-progress acknowledgement sent at `sent_at`: it counts
        only if the confirmation came while the delivery was the worker's (one that came later
        may have extended another worker's delivery)."""
        if not self.lost and confirmed_at < self.until(ack_wait):
            self.held_at = max(self.held_at, sent_at)

    def decide(self, reply: Reply, delay: float = 0.0, handled: Handled | None = None,
               outcome: Outcome | None = None) -> None:  # fmt: skip
        self.reply, self.delay, self.handled, self.outcome = reply, delay, handled, outcome

    def payload(self) -> bytes:
        """The acknowledgement decided, as JetStream reads it on the reply subject."""
        if self.reply is Reply.ACK:
            return b"+ACK"
        if self.reply is Reply.TERM:
            return b"+TERM"
        assert self.reply is Reply.NAK
        if self.delay <= 0:
            return b"-NAK"
        return b"-NAK " + json.dumps({"delay": int(self.delay * 10**9)}).encode()


class DeliveryCounts:
    """The delivery count of each message, as this worker has seen it go: never backwards.

    nats-server before 2.10.14 (Debian 12 ships 2.9.10) may deliver a message it is already
    redelivering once more as a first delivery, with a count of 1, after it failed to deliver
    it to an expired pull request (nats-server#5305, #5338). The job then counted an attempt it
    had spent already: its attempts went 1, 2, 1, and at the server's next count, past its
    max_attempts, it was dead-lettered as a lost worker's ("delivered 4 times without an
    outcome") instead of running its last attempt. A count lower than one this worker saw for
    the same message (its stream, stream sequence and message id: a stream made again numbers
    new messages from 1) is taken as one more than that. Bounded: the LIMIT most recent
    messages.
    """

    LIMIT = 10_000

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, int, str | None], int] = OrderedDict()

    def of(self, msg: Msg) -> int:
        meta = msg.metadata
        key = (meta.stream, meta.sequence.stream, (msg.headers or {}).get("Nats-Msg-Id"))
        count = max(meta.num_delivered, self._seen.pop(key, 0) + 1)
        self._seen[key] = count
        if len(self._seen) > self.LIMIT:
            self._seen.popitem(last=False)
        return count
