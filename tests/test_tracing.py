"""Tracing (issue 36), in process: the wire field, the switch, the span tree.

The real-process test against a real OTLP/HTTP receiver is
``tests/test_tracing_pool.py``; here are the parts that need no process:
SUBMIT's trace context as an optional trailing field, when the OTEL_*
variables turn export on, the throttled export-failure line, and the
spans one streamed request makes through the in-process pool (real broker,
real worker with the synthetic engine, the Falcon app), read from the SDK's
in-memory exporter.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import msgpack
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from protocol import messages, otel_sdk, tracing
from protocol.payloads import GenerationRequest, TraceContext
from protocol.records import MalformedMessage
from tests.inproc_pool import InprocPool, sse_events
from tests.pool import wait_until

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
REQUEST = GenerationRequest("completion", "a prompt nobody may read")


def _decode(body: list) -> messages.Submit:
    frames = [messages.PROTOCOL_HEADER, messages.Submit.COMMAND,
              msgpack.packb(body)]
    return messages.decode(frames)


# --- the wire ------------------------------------------------------------------------


#: Where SUBMIT carries the trace: after the fields older peers know, before
#: those added later (the fair wait's ``client`` and ``max_wait_s``).
TRACE_AT = list(messages.Submit.FIELD_TYPES).index("trace")


def test_submit_carries_the_trace_context_after_the_older_fields():
    msg = messages.Submit("j", REQUEST, trace=TraceContext(PARENT, "k=v"))
    assert list(messages.Submit.FIELD_TYPES)[TRACE_AT - 1] == "key"
    assert _decode(msg.to_body()) == msg


def test_an_older_peers_submit_has_no_trace_and_a_newer_one_is_read():
    body = messages.Submit("j", REQUEST, trace=TraceContext(PARENT)).to_body()
    assert _decode(body[:TRACE_AT]).trace is None     # an older frontend's
    assert _decode([*body, "a future field"]).trace == TraceContext(PARENT)


@pytest.mark.parametrize("trace,why", [
    ([5], r"Submit\.trace\.traceparent: int"),
    (["x" * 129], r"Submit\.trace\.traceparent: 129 characters"),
    ([PARENT, "s" * 513], r"Submit\.trace\.tracestate: 513 characters"),
    ("00-ab", r"Submit\.trace: body is not an array"),
])
def test_a_malformed_trace_context_is_refused_naming_the_field(trace, why):
    body = messages.Submit("j", REQUEST).to_body()
    body[TRACE_AT] = trace
    with pytest.raises(MalformedMessage, match=why):
        _decode(body)


# --- the switch ----------------------------------------------------------------------


@pytest.mark.parametrize("env,on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"},
     False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
     False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
])
def test_export_is_on_only_when_an_otlp_endpoint_is_configured(env, on):
    assert tracing.export_configured(env) is on


@pytest.mark.stack  # a fresh interpreter, to see what it imported
def test_off_the_processes_import_no_opentelemetry():
    script = (
        "import sys\n"
        "from protocol import tracing\n"
        "assert not tracing.configure('frontend')\n"
        "import frontend.app, frontend.endpoint, frontend.generation\n"
        "import workers.broker.broker, workers.model.job_runner\n"
        "import workers.model.prompt_reuse, llamapool.cli\n"
        "from tests.inproc_pool import InprocPool\n"
        "pool = InprocPool(workers=1)\n"
        "try:\n"
        "    r = pool.client().simulate_post('/v1/completions', json={\n"
        "        'prompt': 'hi', 'max_tokens': 3, 'stream': True})\n"
        "    assert r.status_code == 200 and 'traceparent' not in r.headers\n"
        "finally:\n"
        "    pool.stop()\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
        "print('clean')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.getcwd(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("clean")


# --- an unreachable collector -------------------------------------------------


class _Refusing(SpanExporter):
    def export(self, spans):
        return SpanExportResult.FAILURE


def test_export_failures_are_one_log_line_per_window(caplog):
    exporter = otel_sdk.ThrottledExporter(_Refusing(), "http://c:4318")
    with caplog.at_level(logging.WARNING, logger="llamapool.tracing"):
        for _ in range(5):
            assert exporter.export([]) is SpanExportResult.FAILURE
    lines = [r for r in caplog.records if r.name == "llamapool.tracing"]
    assert len(lines) == 1 and "could not export" in lines[0].getMessage()
    assert exporter.failed_batches == 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_exporter_to_a_closed_port_logs_only_our_line(caplog):
    otel_sdk._exporter({})  # silences the exporter's own lines, as start does
    url = f"http://127.0.0.1:{_closed_port()}/v1/traces"
    exporter = otel_sdk.ThrottledExporter(OTLPSpanExporter(url, timeout=0.3), url)
    span = TracerProvider().get_tracer("t").start_span("s")
    span.end()
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            assert exporter.export([span]) is SpanExportResult.FAILURE
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["llamapool.tracing"], [
        r.getMessage() for r in warnings]


# --- the span tree of one request, in process ---------------------------------


@pytest.fixture
def spans():
    """Tracing on in this process, into memory; off again after."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.TRACER = provider.get_tracer("test")
    try:
        yield exporter
    finally:
        tracing.TRACER = None
        provider.shutdown()


def test_one_streamed_request_is_one_trace_with_linked_spans(spans):
    pool = InprocPool(workers=1)
    try:
        client = pool.client()
        resp = client.simulate_post(
            "/v1/completions", json={"prompt": "a secret prompt", "max_tokens": 4,
                                     "stream": True},
            headers={"traceparent": PARENT})
        assert resp.status_code == 200
        assert sse_events(resp.text)[-1] == "[DONE]"
        names = {"POST /v1/completions", "frontend.auth", "frontend.parse",
                 "frontend.job", "frontend.slot_wait", "frontend.first_frame",
                 "frontend.stream", "broker.placement", "worker.job",
                 "worker.prefill", "worker.decode"}
        wait_until(lambda: names <= {s.name for s in spans.get_finished_spans()},
                   10, "every span to end")
        pool.assert_whole()
    finally:
        pool.stop()
    by_name = {s.name: s for s in spans.get_finished_spans()}
    trace_id = int(PARENT.split("-")[1], 16)
    assert {s.context.trace_id for s in by_name.values()} == {trace_id}
    server = by_name["POST /v1/completions"]
    assert server.parent.span_id == int(PARENT.split("-")[2], 16)
    job = by_name["frontend.job"]

    def parent(name):
        return by_name[name].parent.span_id

    for child in ("frontend.auth", "frontend.parse", "frontend.job"):
        assert parent(child) == server.context.span_id, child
    for child in ("frontend.slot_wait", "frontend.first_frame", "frontend.stream",
                  "broker.placement", "worker.job"):
        assert parent(child) == job.context.span_id, child
    for child in ("worker.prefill", "worker.decode"):
        assert parent(child) == by_name["worker.job"].context.span_id, child
    assert resp.headers["traceparent"].split("-")[1:3] == [
        f"{trace_id:032x}", f"{server.context.span_id:016x}"]
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["llamapool.stream"] is True
    assert server.attributes["llamapool.lease_ending"] == "eof"
    assert by_name["broker.placement"].attributes["llamapool.placed"] is True
    assert by_name["worker.decode"].attributes["llamapool.tokens"] == 4
    assert "a secret prompt" not in json.dumps(
        [dict(s.attributes) for s in by_name.values()])


def test_a_request_without_traceparent_starts_a_trace(spans):
    pool = InprocPool(workers=1)
    try:
        resp = pool.client().simulate_post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200
        wait_until(lambda: "worker.job" in {
            s.name for s in spans.get_finished_spans()}, 10, "the worker's span")
        version, trace_hex, span_hex, flags = resp.headers["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1  # sampled
        assert int(trace_hex, 16)
    finally:
        pool.stop()
    server = next(s for s in spans.get_finished_spans()
                  if s.name == "POST /v1/completions")
    assert server.parent is None
    assert f"{server.context.trace_id:032x}" == trace_hex


def test_clock_readings_become_span_timestamps():
    before = time.time_ns()
    stamp = otel_sdk.wall_ns(time.monotonic() - 1.0)
    assert before - 1.1e9 < stamp < time.time_ns() - 0.9e9


def test_health_checks_and_scrapes_make_no_trace(spans):
    pool = InprocPool(workers=1)
    try:
        client = pool.client()
        for path in ("/health", "/metrics"):
            resp = client.simulate_get(path)
            assert resp.status_code == 200 and "traceparent" not in resp.headers
        assert "traceparent" in client.simulate_get("/v1/models").headers
    finally:
        pool.stop()
    assert sorted(s.name for s in spans.get_finished_spans()) == [
        "GET /v1/models", "frontend.auth"]


@pytest.mark.parametrize("env,path,excluded", [
    ({}, "/health", True),
    ({}, "/healthz", False),
    ({}, "/v1/completions", False),
    ({"OTEL_PYTHON_EXCLUDED_URLS": "slots,^/v1/models"}, "/slots", True),
    ({"OTEL_PYTHON_EXCLUDED_URLS": "slots,^/v1/models"}, "/health", False),
])
def test_the_excluded_paths_follow_the_instrumentations_variable(env, path,
                                                                 excluded):
    from frontend.request_trace import excluded_paths

    assert bool(excluded_paths(env).search(path)) is excluded


def test_the_otlp_traces_endpoint_flag_turns_tracing_on_for_every_process():
    from llamapool.cli import build_parser, export_traces_to

    for command in (["broker"], ["worker", "--model", "m.gguf"], ["frontend"], ["up"]):
        args = build_parser().parse_args(
            ["--otlp-traces-endpoint", "http://collector:4318/v1/traces", *command])
        environ: dict[str, str] = {}
        export_traces_to(args.otlp_traces_endpoint, environ)
        assert environ == {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}
        assert tracing.export_configured(environ)
    args = build_parser().parse_args(["broker"])
    environ = {}
    export_traces_to(args.otlp_traces_endpoint, environ)
    assert environ == {} and not tracing.export_configured(environ)
