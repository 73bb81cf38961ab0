"""Tracing with OpenTelemetry (PGJOBS["TRACING"]): an enqueue's send span, its context carried in
the job's headers, and the worker's process span linked to it; and no cost when it is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from django_pgjobs import checks
from django_pgjobs.models import Job
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import tasks
from tests.framework_tasks import failing_value_error

ROOT = Path(__file__).resolve().parents[2]
_exporter = InMemorySpanExporter()


class FaultySpanProcessor(SpanProcessor):
    """A span processor (the application's, say) that raises where it is told to: at the
    start or at the end of every span."""

    raises_at: str | None = None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self.raises_at == "start":
            raise RuntimeError("a span processor broken at on_start")

    def on_end(self, span: ReadableSpan) -> None:
        if self.raises_at == "end":
            raise RuntimeError("a span processor broken at on_end")


_faulty = FaultySpanProcessor()


class FaultyPropagator(TextMapPropagator):
    """A propagator (the application's, say) that raises whatever it is asked."""

    def extract(self, carrier: object, context: object = None, getter: object = None) -> Context:
        raise RuntimeError("a propagator broken at extract")

    def inject(self, carrier: object, context: object = None, setter: object = None) -> None:
        raise RuntimeError("a propagator broken at inject")

    @property
    def fields(self) -> set[str]:
        return {"traceparent"}


@pytest.fixture(scope="module", autouse=True)
def _provider() -> None:
    # The global provider can be set once per process; nothing else in the suite sets one.
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        provider.add_span_processor(_faulty)  # after the exporter: the spans are exported
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans(settings: object) -> Iterator[InMemorySpanExporter]:
    """Tracing on, and the spans finished during the test."""
    settings.PGJOBS = {**settings.PGJOBS, "TRACING": True}  # type: ignore[attr-defined]
    _exporter.clear()
    yield _exporter
    _exporter.clear()
    _faulty.raises_at = None


def drain() -> None:
    """Run what is due with a real worker, in this process, until nothing is."""
    Worker(Options(queues=["default"], once=True, listen=False, concurrency=2)).run()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_a_request_runs_in_a_process_span_linked_to_the_enqueue(spans):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request:
        job = tasks.opens_a_span.enqueue()

    (send,) = named(spans, "send default")
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "pgjobs",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "default",
        "messaging.message.id": str(job.pk),
        "messaging.pgjobs.task.name": "tests.tasks.opens_a_span",
    }
    # The send span's context is the job's creation context, stored in its headers.
    trace_id, span_id = f"{send.context.trace_id:032x}", f"{send.context.span_id:016x}"
    written = Job.objects.get(pk=job.pk).headers
    assert written == job.headers
    assert written["traceparent"].startswith(f"00-{trace_id}-{span_id}-")  # then the flags

    drain()

    (process,) = named(spans, "process default")
    assert process.kind is SpanKind.CONSUMER
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    # No span is current on the worker's handler thread: the run joins the request's trace.
    assert process.context.trace_id == request.get_span_context().trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    attributes = dict(process.attributes or {})
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.destination.name"] == "default"
    assert attributes["messaging.message.id"] == str(job.pk)
    assert attributes["messaging.pgjobs.task.name"] == "tests.tasks.opens_a_span"
    assert attributes["messaging.pgjobs.job.attempt"] == 1
    assert attributes["messaging.client.id"].startswith(f"{os.uname().nodename[:150]}:")
    assert process.status.status_code is StatusCode.UNSET
    # The handler runs inside the process span: its own spans are the span's children.
    (inside,) = named(spans, "inside the handler")
    assert inside.parent is not None and inside.parent.span_id == process.context.span_id


@pytest.mark.django_db(transaction=True)
def test_a_failed_attempt_records_its_exception_on_the_process_span(spans):
    job = Job.objects.enqueue("tests.tasks.always_fails")

    drain()

    attempts = named(spans, "process default")
    assert attempts, "the job ran"
    for n, span in enumerate(attempts, start=1):
        assert span.attributes is not None
        assert span.attributes["messaging.pgjobs.job.attempt"] == n
        assert span.attributes["error.type"] == "RuntimeError"
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "RuntimeError: boom"
        (event,) = span.events
        assert event.name == "exception"
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "RuntimeError"
        assert event.attributes["exception.message"] == "boom"
        assert "raise RuntimeError" in str(event.attributes["exception.stacktrace"])
    assert Job.objects.get(pk=job.pk).errors[0]["type"] == "RuntimeError"


@pytest.mark.django_db(transaction=True)
def test_a_retry_is_not_an_error_on_the_process_span(spans):
    Job.objects.enqueue("tests.tasks.asks_to_retry", {"seconds": 60})

    drain()

    (process,) = named(spans, "process default")
    assert process.status.status_code is StatusCode.UNSET
    assert not process.events


@pytest.mark.django_db(transaction=True)
def test_a_bulk_enqueue_is_one_send_span_whose_context_every_job_carries(spans):
    jobs = Job.objects.bulk_enqueue("tests.tasks.noop", [{}, {}, {}])

    (send,) = named(spans, "send default")
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in send.attributes
    stored = Job.objects.filter(pk__in=[job.pk for job in jobs]).values_list(
        "headers__traceparent", flat=True
    )
    assert len(stored) == 3
    assert {value[:-3] for value in stored} == {
        f"00-{send.context.trace_id:032x}-{send.context.span_id:016x}"
    }

    drain()

    runs = named(spans, "process default")
    assert len(runs) == 3
    assert {link.context.span_id for span in runs for link in span.links} == {send.context.span_id}


@pytest.mark.django_db
def test_run_jobs_inside_a_span_runs_each_job_as_its_child_linked_to_the_enqueue(spans):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("enqueueing request"):
        Job.objects.enqueue("tests.tasks.noop")
    with tracer.start_as_current_span("the test") as test_span:
        run_jobs()

    (send,) = named(spans, "send default")
    (process,) = named(spans, "process default")
    # In the scope of another span, the conventions' default: its child, linked to the enqueue.
    assert process.parent is not None
    assert process.parent.span_id == test_span.get_span_context().span_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]


@pytest.mark.django_db
def test_a_job_enqueued_outside_any_trace_runs_in_a_trace_of_its_own(spans):
    Job.objects.enqueue("tests.tasks.noop")

    run_jobs()

    (send,) = named(spans, "send default")
    (process,) = named(spans, "process default")
    assert send.parent is None  # a new trace, begun by the enqueue
    assert process.context.trace_id == send.context.trace_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]


@pytest.mark.django_db
def test_headers_that_are_not_a_trace_context_run_in_a_trace_of_their_own(spans):
    job = Job.objects.enqueue("tests.tasks.noop")
    Job.objects.filter(pk=job.pk).update(headers=["not", "a", "dict"])
    _exporter.clear()

    run = run_jobs()

    assert run.counts == {Status.SUCCEEDED: 1}
    (process,) = named(spans, "process default")
    assert process.parent is None and not process.links


#: A trace context as W3C Trace Context writes it: span 0x2222222222222222 of trace 0x1111….
TRACEPARENT = f"00-{'1' * 32}-{'2' * 16}-01"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("headers", "linked"),
    [
        ({"traceparent": 5}, False),
        ({"traceparent": [5]}, False),
        ({"baggage": 5}, False),
        ({"traceparent": TRACEPARENT, "tracestate": 7}, True),  # what can be read is
    ],
)
def test_headers_that_are_not_text_never_keep_the_job_from_running(spans, headers, linked):
    # The column is JSON that anyone with access to the table could have written.
    job = Job.objects.enqueue("tests.tasks.noop")
    Job.objects.filter(pk=job.pk).update(headers=headers)
    runs = tasks.calls["noop"]

    drain()

    job.refresh_from_db()
    assert (job.status, job.errors) == (Status.SUCCEEDED, [])
    assert tasks.calls["noop"] == runs + 1
    (process,) = named(spans, "process default")
    assert [link.context.span_id for link in process.links] == [0x2222222222222222] * linked


@pytest.mark.django_db
def test_a_header_too_long_to_be_one_is_dropped_without_logging_it(spans, caplog):
    job = Job.objects.enqueue("tests.tasks.noop")
    baggage = "k=v," * 1_000_000  # 4 MB: OpenTelemetry would log all of it, at every attempt
    Job.objects.filter(pk=job.pk).update(headers={"traceparent": TRACEPARENT, "baggage": baggage})
    _exporter.clear()

    assert run_jobs().counts == {Status.SUCCEEDED: 1}

    (process,) = named(spans, "process default")
    assert [link.context.span_id for link in process.links] == [0x2222222222222222]
    assert max((len(record.getMessage()) for record in caplog.records), default=0) < 10_000


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("raises_at", ["start", "end"])
def test_a_span_processor_that_raises_never_fails_an_enqueue(spans, raises_at, caplog):
    _faulty.raises_at = raises_at

    # Raising after the INSERT (on_end), in autocommit, would leave a job written by an enqueue
    # that failed: a caller trying again writes it twice.
    job = Job.objects.enqueue("tests.tasks.noop")
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}, {}])

    assert Job.objects.count() == 3
    assert Job.objects.get(pk=job.pk).status == Status.READY
    assert f"a span processor broken at on_{raises_at}" in caplog.text


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("raises_at", ["start", "end"])
def test_a_span_processor_that_raises_never_turns_a_run_into_a_failure(spans, raises_at, caplog):
    job = Job.objects.enqueue("tests.tasks.noop")
    runs = tasks.calls["noop"]
    _faulty.raises_at = raises_at

    drain()

    job.refresh_from_db()
    assert (job.status, job.attempts, job.errors) == (Status.SUCCEEDED, 1, [])
    assert tasks.calls["noop"] == runs + 1  # ran once: its success was recorded
    assert f"a span processor broken at on_{raises_at}" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_propagator_that_raises_fails_neither_the_enqueue_nor_the_run(spans, caplog):
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(FaultyPropagator())
    try:
        job = Job.objects.enqueue("tests.tasks.noop")
        drain()
    finally:
        propagate.set_global_textmap(previous)

    job.refresh_from_db()
    assert (job.status, job.attempts, job.headers) == (Status.SUCCEEDED, 1, None)
    assert "a propagator broken at inject" in caplog.text
    assert "a propagator broken at extract" in caplog.text


#: Enqueues and runs three jobs in a fresh process (PGJOBS as given in $PGJOBS_TEST_OVERRIDE),
#: then says what the jobs' statuses and headers are and which opentelemetry modules it imported.
IN_A_FRESH_PROCESS = """
import json, os, sys
import django
django.setup()
from django.test import override_settings
from django_pgjobs.models import Job
from django_pgjobs.runtime.worker import Options, Worker
with override_settings(PGJOBS=json.loads(os.environ["PGJOBS_TEST_OVERRIDE"])):
    Job.objects.enqueue("tests.tasks.noop")
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}, {}])
    Worker(Options(queues=["default"], once=True, listen=False, concurrency=1)).run()
print(json.dumps({
    "jobs": list(Job.objects.values_list("status", "headers")),
    "otel": sorted(name for name in sys.modules if name.startswith("opentelemetry")),
}))
"""


def in_a_fresh_process(pgjobs: dict[str, object]) -> dict[str, object]:
    # A process of its own: this one has imported opentelemetry for the tests above.
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PGJOBS_TEST_DATABASE": connection.settings_dict["NAME"],
        "PGJOBS_TEST_OVERRIDE": json.dumps(pgjobs),
    }
    done = subprocess.run(
        [sys.executable, "-c", IN_A_FRESH_PROCESS], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return seen


@pytest.mark.django_db(transaction=True)
def test_without_tracing_no_headers_are_written_and_opentelemetry_is_never_imported():
    seen = in_a_fresh_process({})

    assert seen == {"jobs": [["succeeded", None]] * 3, "otel": []}


@pytest.mark.django_db(transaction=True)
def test_with_tracing_but_no_sdk_configured_no_headers_are_written():
    seen = in_a_fresh_process({"TRACING": True})

    assert seen["jobs"] == [["succeeded", None]] * 3
    assert "opentelemetry.trace" in seen["otel"]  # tracing was on: the spans were no-ops


def test_the_check_errors_when_tracing_is_on_but_opentelemetry_cannot_be_imported(
    settings, monkeypatch
):
    settings.PGJOBS = {"TRACING": True}
    assert checks.check_tracing() == []

    monkeypatch.setitem(sys.modules, "opentelemetry.propagate", None)

    (error,) = checks.check_tracing()
    assert error.id == "pgjobs.E030"
    assert "django-pgjobs[otel]" in str(error.hint)


def test_the_check_is_silent_when_tracing_is_off(settings, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.propagate", None)
    assert checks.check_tracing() == []


@pytest.mark.django_db
def test_a_task_of_djangos_tasks_framework_is_traced_like_any_job(spans):
    failing_value_error.enqueue()
    run_jobs()

    name = "django.tasks:tests.framework_tasks.failing_value_error"
    (send,) = named(spans, "send default")
    (process,) = named(spans, "process default")
    assert send.attributes is not None and process.attributes is not None
    assert send.attributes["messaging.pgjobs.task.name"] == name
    assert process.attributes["messaging.pgjobs.task.name"] == name
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert process.status.status_code is StatusCode.ERROR
    assert process.attributes["error.type"] == "ValueError"


@pytest.mark.django_db
def test_a_replayed_dead_letter_runs_linked_to_the_enqueue_that_created_it(spans):
    job = Job.objects.enqueue("tests.tasks.fails_permanently")
    run_jobs()
    (send,) = named(spans, "send default")
    _exporter.clear()

    Job.objects.filter(pk=job.pk).replay()
    run_jobs()

    (process,) = named(spans, "process default")
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
