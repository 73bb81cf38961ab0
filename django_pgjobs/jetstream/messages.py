"""A job as a JetStream message, and back.

The body is JSON: the job's id, task, payload and the rest of what running it needs. Its
headers are the job's own `headers` (trace context), plus `Nats-Msg-Id`, by which the stream
drops a second publish of the same message (a relay that died between publish and commit),
and `Pgjobs-Task`, for other consumers that filter by task.

The message id is the job's id and its claim count (`<id>:<claims>`). A job written back as a
dead letter counts one claim more than the message it came from, so its replay goes out under a
new id, which the stream's duplicate window cannot mistake for the first one. A message given
back unstarted is replaced by a copy under an id of its own (given_back).
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from typing import Any
from uuid import UUID

from django.utils import timezone
from nats.aio.msg import Msg

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.validation import MAX_PRIORITY, MIN_PRIORITY

#: The version of the body's shape, so that a later release can read what this one wrote.
VERSION = 1

_HEADER_NAME = re.compile(r"[!-9;-~]+")
_LINE_BREAK = re.compile(r"[\r\n]")


def message_id(job: Job) -> str:
    return f"{job.pk}:{job.claims}"


def body(job: Job) -> bytes:
    return json.dumps(
        {
            "v": VERSION,
            "id": str(job.pk),
            "queue": job.queue,
            "task": job.task,
            "payload": job.payload,
            "priority": job.priority,
            "run_at": job.run_at.isoformat(),
            "created_at": job.created_at.isoformat(),
            # Attempts made before this message: in a PostgreSQL queue, or by the deliveries
            # of the message it replaces (given_back).
            "attempts": job.attempts,
            "max_attempts": job.max_attempts,
            "claims": job.claims,
            "errors": job.errors,
            "headers": job.headers,
        },
        separators=(",", ":"),
        ensure_ascii=False,  # UTF-8 as it is: an escape is six bytes for a character's three
    ).encode()


def headers(job: Job) -> dict[str, str]:
    """The message's headers: the job's own (those a NATS header can carry: a name of visible
    ASCII without ':', a value without line breaks; the body carries them all), then ours."""
    carried = {
        name: value
        for name, value in ((str(k), str(v)) for k, v in (job.headers or {}).items())
        if _HEADER_NAME.fullmatch(name) and not _LINE_BREAK.search(value)
    }
    return carried | {"Nats-Msg-Id": message_id(job), "Pgjobs-Task": job.task}


def size(body: bytes, headers: dict[str, str]) -> int:
    """The bytes of a message the server counts against its max_payload: the body and the
    header block as nats-py writes it (``NATS/1.0``, then ``name: value`` per header, each line
    ended by CRLF, and an empty line)."""
    lines = [b"NATS/1.0"]
    lines += [f"{name.strip()}: {value.strip()}".encode() for name, value in headers.items()]
    return len(body) + sum(len(line) + 2 for line in lines) + 2


def given_back(job: Job, msg: Msg) -> tuple[str, bytes, dict[str, str]]:
    """A copy of the delivered message `msg` of `job` (as job_of read it), to publish in its
    place when it goes back unstarted: its next delivery counts the attempts this one counted,
    so a delivery that never ran spends none. Its message id names the delivery it replaces
    (`<id>:<claims>:<stream sequence>.<delivery>`): published twice, it is stored once."""
    unstarted = copy.copy(job)
    unstarted.attempts, unstarted.claims = job.attempts - 1, job.claims - 1
    meta = msg.metadata
    given_id = f"{message_id(unstarted)}:{meta.sequence.stream}.{meta.num_delivered}"
    return msg.subject, body(unstarted), headers(unstarted) | {"Nats-Msg-Id": given_id}


def job_of(msg: Msg, worker: str, delivered: int | None = None) -> Job:
    """The job a delivered message carries, as an unsaved Job running on `worker`: its
    attempts count this delivery, the `delivered`th (by default the server's count), and those
    made before it entered the stream; its claims one more than the message's (see the
    module's docstring)."""
    data: dict[str, Any] = json.loads(msg.data)
    if not isinstance(data, dict):
        raise ValueError(f"the message is JSON {type(data).__name__}, not an object")
    return Job(
        id=UUID(data["id"]),
        queue=_typed(data, "queue", str),
        task=_typed(data, "task", str),
        payload=_typed(data, "payload", dict),
        status=Status.RUNNING,
        priority=_counted(data, "priority", MIN_PRIORITY, MAX_PRIORITY),
        run_at=datetime.fromisoformat(data["run_at"]),
        created_at=datetime.fromisoformat(data["created_at"]),
        attempts=min(
            _counted(data, "attempts", 0, MAX_COUNT) + (delivered or msg.metadata.num_delivered),
            MAX_COUNT,
        ),
        max_attempts=_counted(data, "max_attempts", 1, MAX_COUNT),
        worker=worker,
        errors=_typed(data, "errors", list),
        claims=_counted(data, "claims", 0, MAX_COUNT - 1) + 1,
        headers=data["headers"] if data["headers"] is None else _typed(data, "headers", dict),
        started_at=timezone.now(),  # for the claim latency in the workers' statistics
    )


def due_at(data: bytes | None) -> datetime | None:
    """When the job in a message's body was due (its run_at, written by the database's
    clock); None for a body that is not one of ours."""
    try:
        due = datetime.fromisoformat(json.loads(data or b"")["run_at"])
    except (ValueError, TypeError, KeyError, RecursionError):  # deep nesting: RecursionError
        return None
    return due if timezone.is_aware(due) else None


#: The largest attempt or claim count a job's row holds (an int4 column).
MAX_COUNT = 2**31 - 1


def _typed(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data[key]
    if not isinstance(value, kind):
        raise TypeError(f"{key!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def _counted(data: dict[str, Any], key: str, low: int, high: int) -> int:
    value = _typed(data, key, int)
    if isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key!r} is {value!r}, outside {low}..{high}")
    return int(value)
