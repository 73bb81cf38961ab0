"""OpenTelemetry tracing of enqueues and job runs, after the messaging semantic conventions.

Imported only when ``PGJOBS["TRACING"]`` is on, so that without it opentelemetry is never
imported (the ``otel`` extra); the application configures the SDK and its exporters.

- An enqueue is a ``send {queue}`` span (kind PRODUCER), one per statement, whose context the
  configured propagator writes into the jobs' ``headers``: their *creation context*.
- A run is a ``process {queue}`` span (kind CONSUMER) around the handler, linked to the creation
  context, and its child unless another span is current. A failed attempt records its
  exception and sets the status to ERROR; a Retry is no error.

Tracing never changes what happens to jobs: unreadable headers start a trace of their own, and
an exception from the SDK (a span processor, a propagator) is logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from django_pgjobs.outcomes import Handled, Verdict

if TYPE_CHECKING:
    from django_pgjobs.data.records import NewJob
    from django_pgjobs.models import Job

logger = logging.getLogger(__name__)

#: The longest header value read from a job: W3C Trace Context and Baggage allow 8,192 bytes.
HEADER_LENGTH = 8192

#: `messaging.system`: not one of the conventions' well-known systems, so our own name.
SYSTEM = "pgjobs"


@cache
def tracer() -> trace.Tracer:
    # The global provider's, resolved lazily (a ProxyTracer until the application sets one).
    return trace.get_tracer("django_pgjobs")


@contextmanager
def sending(first: NewJob, count: int) -> Iterator[dict[str, str] | None]:
    """The span of one statement that writes `count` jobs like `first` (one queue, one task).
    Yields the headers to write with them: the span's context as the propagator writes it, or
    None when there is nothing to carry (no SDK configured)."""
    attributes: dict[str, str | int] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": first.queue,
        "messaging.pgjobs.task.name": first.task,
    }
    if count == 1:
        attributes["messaging.message.id"] = str(first.id)
    else:
        attributes["messaging.batch.message_count"] = count
    with _span(f"send {first.queue}", kind=SpanKind.PRODUCER, attributes=attributes):
        carrier: dict[str, str] = {}
        try:
            propagate.inject(carrier)
        except Exception:
            logger.warning("tracing: the propagator could not write the context", exc_info=True)
            carrier = {}
        yield carrier or None


def processed(job: Job, run: Callable[[Job], Handled]) -> Handled:
    """`run(job)` inside the job's process span; how it ended, recorded on the span."""
    creation = _creation_context(job)
    created = trace.get_current_span(creation).get_span_context()
    links = [Link(created)] if created.is_valid else []
    # Parent: the span current here if there is one, else the creation context.
    ambient = trace.get_current_span().get_span_context().is_valid
    attributes: dict[str, str | int] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.pk),
        "messaging.pgjobs.task.name": job.task,
        "messaging.pgjobs.job.attempt": job.attempts,
    }
    if job.worker:
        attributes["messaging.client.id"] = job.worker
    with _span(
        f"process {job.queue}",
        context=None if ambient else creation,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
        errors=False,  # run() never raises: how the handler ended is in what it returns
    ) as span:
        handled = run(job)
        _record(span, handled)
    return handled


@contextmanager
def _span(
    name: str,
    *,
    kind: SpanKind,
    attributes: dict[str, str | int],
    context: Context | None = None,
    links: Sequence[Link] = (),
    errors: bool = True,
) -> Iterator[trace.Span]:
    """A span current around the block, recording an exception that leaves it when `errors`.

    A span processor's exception at start or end is logged, not raised: else an enqueue would
    raise after its INSERT (a retry writes the job twice), or a job that ran would be recorded
    as failed.
    """
    try:
        span = tracer().start_span(
            name, context=context, kind=kind, attributes=attributes, links=links
        )
    except Exception:
        logger.warning("tracing: could not start the span %r", name, exc_info=True)
        span = trace.INVALID_SPAN
    try:
        with trace.use_span(span, record_exception=errors, set_status_on_exception=errors):
            yield span
    finally:
        try:
            span.end()
        except Exception:
            logger.warning("tracing: could not end the span %r", name, exc_info=True)


def _record(span: trace.Span, handled: Handled) -> None:
    if handled.verdict is not Verdict.ERROR or handled.failure is None:
        return  # success, or a Retry: not an error
    failure = handled.failure
    # What Span.record_exception writes, from the error history's entry (the exception is gone).
    span.add_event(
        "exception",
        {
            "exception.type": failure.type,
            "exception.message": failure.message,
            "exception.stacktrace": failure.traceback,
        },
    )
    span.set_attribute("error.type", failure.type)
    span.set_status(Status(StatusCode.ERROR, failure.summary))


def _creation_context(job: Job) -> Context:
    """The trace context the job's headers carry; an empty one when they carry none we can read."""
    try:
        return propagate.extract(_carrier(job.headers))
    except Exception:  # a propagator of the application's, refusing what it reads
        logger.warning("tracing: the headers of job %s cannot be read", job.pk, exc_info=True)
        return Context()


def _carrier(headers: Any) -> Mapping[str, str]:
    # The column is JSON anyone with access to the table could have written: only text values
    # no longer than a header can be (the default propagators raise on anything else).
    if not isinstance(headers, dict):
        return {}
    return {
        key: value
        for key, value in headers.items()
        if isinstance(value, str) and len(value) <= HEADER_LENGTH
    }
