"""The one vocabulary of how an attempt ends: what the handler did, and what was recorded.

A handler's run ends in a `Verdict`, carried with its details by `Handled`. Recording it leaves
the job in a status, from which the attempt's `Outcome` follows (LOST when the worker no longer
held the claim): signals, statistics and logs all speak of Outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum

from django_pgjobs.data.records import Failure
from django_pgjobs.status import Status


class Verdict(Enum):
    SUCCEEDED = "succeeded"
    RETRY = "retry"  # the handler raised Retry: run again later, not an error
    ERROR = "error"


@dataclass(frozen=True)
class Handled:
    """What running one job's handler produced, before it is recorded."""

    verdict: Verdict
    #: Seconds before the next try (RETRY, or ERROR with attempts left).
    delay: float = 0.0
    failure: Failure | None = None
    permanent: bool = False
    #: The handler's wall time in seconds.
    duration: float = 0.0
    #: The return value as JSON text, for a task that keeps its result; None keeps nothing.
    result_json: str | None = None


class Outcome(StrEnum):
    """How an attempt's end was recorded."""

    SUCCEEDED = "succeeded"
    RETRIED = "retried"  # ready again, later
    FAILED = "failed"  # the dead letter
    CANCELLED = "cancelled"
    LOST = "lost"  # the worker no longer held the claim: nothing was recorded

    @classmethod
    def of_status(cls, status: str | None) -> Outcome:
        """The outcome of an attempt that left its job in `status` (None: not recorded)."""
        return _OF_STATUS.get(status or "", cls.LOST)


_OF_STATUS: dict[str, Outcome] = {
    Status.SUCCEEDED: Outcome.SUCCEEDED,
    Status.READY: Outcome.RETRIED,
    Status.FAILED: Outcome.FAILED,
    Status.CANCELLED: Outcome.CANCELLED,
}
