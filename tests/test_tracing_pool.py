"""One request, one trace, through real processes, read by a real OTLP receiver.

gunicorn (the frontend), the broker and a worker on the tiny test model run
as processes with the standard OTEL_* variables pointing at an OTLP/HTTP
endpoint served by this module: an HTTP server thread that decodes each
``ExportTraceServiceRequest`` with ``opentelemetry-proto``, so what is
checked is the wire format the SDK really sends. One streamed chat request
with a client ``traceparent``, then: one trace id across the three
processes, each process's ``service.name``, the parent-child links (the
broker's and the worker's spans under the frontend's ``frontend.job``), the
attributes an operator filters on, the ``traceparent`` answered, and the
prompt's text nowhere in any byte exported.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.pool import sse_events, wait_until
from tests.test_slot_paths import hold_slot

pytestmark = pytest.mark.stack

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "zebra-lighthouse-7731 tells a story"

FRONTEND = {"POST /v1/chat/completions", "frontend.auth", "frontend.parse",
            "frontend.prompt_gate", "frontend.job", "frontend.slot_wait",
            "frontend.first_frame", "frontend.stream"}
BROKER = {"broker.placement"}
WORKER = {"worker.job", "worker.prompt_plan", "worker.prefill", "worker.decode"}


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint in a thread: every request's raw bytes,
    and its spans decoded, as (service.name, span) pairs."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.take(self.path, body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       name="otlp-receiver", daemon=True)
        self.thread.start()

    def take(self, path: str, body: bytes) -> None:
        assert path == "/v1/traces", path
        request = ExportTraceServiceRequest.FromString(body)
        with self._lock:
            self.raw.append(body)
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value
                               for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, s) for s in scope.spans)

    def of_trace(self, trace_id: str) -> dict[str, tuple[str, object]]:
        with self._lock:
            return {s.name: (service, s) for service, s in self.spans
                    if s.trace_id.hex() == trace_id}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def _pool_with(pool_factory, otel_env: dict[str, str], **options):
    """A private one-worker pool whose three kinds of process all start with
    ``otel_env`` (each inherits this process's environment)."""
    saved = dict(os.environ)
    os.environ.update(otel_env)
    try:
        pools = pool_factory(workers=1, private=True, **options)
        pool = pools.__enter__()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield pool
    finally:
        pools.__exit__(None, None, None)


def _receiver_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            # Spans reach the receiver within 0.1 s of ending.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on"}


@pytest.fixture(scope="module")
def traced_pool(pool_factory):
    receiver = OtlpReceiver()
    try:
        with _pool_with(pool_factory, _receiver_env(receiver)) as pool:
            yield pool, receiver
    finally:
        receiver.stop()


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        out[a.key] = (list(v.string_value for v in value.array_value.values)
                      if kind == "array_value" else getattr(value, kind))
    return out


def _tree(spans: dict[str, tuple[str, object]]) -> str:
    """The trace as an indented tree with durations (printed with -s)."""
    by_id = {s.span_id: (name, service, s) for name, (service, s) in spans.items()}
    children: dict[bytes, list] = {}
    for name, service, s in by_id.values():
        children.setdefault(s.parent_span_id, []).append((name, service, s))
    lines: list[str] = []

    def walk(parent: bytes, depth: int) -> None:
        for name, service, s in sorted(children.get(parent, []),
                                       key=lambda c: c[2].start_time_unix_nano):
            ms = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
            lines.append(f"{'  ' * depth}{name} [{service}] {ms:.2f} ms")
            walk(s.span_id, depth + 1)

    roots = [s.parent_span_id for _, _, s in by_id.values()
             if s.parent_span_id not in by_id]
    for root in dict.fromkeys(roots):
        walk(root, 0)
    return "\n".join(lines)


def test_one_streamed_request_is_one_trace_across_the_three_processes(traced_pool):
    pool, receiver = traced_pool
    with httpx.Client(base_url=pool.url, timeout=60) as client, client.stream(
            "POST", "/v1/chat/completions",
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            json={"messages": [{"role": "user", "content": PROMPT}],
                  "max_tokens": 6, "stream": True}) as resp:
        assert resp.status_code == 200
        answered = resp.headers["traceparent"]
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    expected = FRONTEND | BROKER | WORKER
    wait_until(lambda: expected <= set(receiver.of_trace(TRACE_ID)), 30,
               "every span of the request at the receiver")
    spans = receiver.of_trace(TRACE_ID)
    print("\n" + _tree(spans))
    pool.assert_whole()

    # One trace, each process under its own name.
    for names, service in ((FRONTEND, "llamapool-frontend"),
                           (BROKER, "llamapool-broker"),
                           (WORKER, "llamapool-worker")):
        assert {spans[n][0] for n in names} == {service}, names

    def span(name):
        return spans[name][1]

    def parent_of(name) -> str:
        parent = span(name).parent_span_id.hex()
        return next(n for n, (_, s) in spans.items() if s.span_id.hex() == parent)

    server = span("POST /v1/chat/completions")
    assert server.parent_span_id.hex() == CLIENT_SPAN  # the client's honoured
    assert answered == f"00-{TRACE_ID}-{server.span_id.hex()}-01"
    for child in ("frontend.auth", "frontend.parse", "frontend.prompt_gate",
                  "frontend.job"):
        assert parent_of(child) == "POST /v1/chat/completions", child
    for child in ("frontend.slot_wait", "frontend.first_frame", "frontend.stream",
                  "broker.placement", "worker.job"):
        assert parent_of(child) == "frontend.job", child
    for child in ("worker.prompt_plan", "worker.prefill", "worker.decode"):
        assert parent_of(child) == "worker.job", child

    # What an operator filters on.
    s = _attrs(server)
    assert s["http.route"] == "/v1/chat/completions"
    assert s["http.response.status_code"] == 200
    assert s["llamapool.stream"] is True and s["llamapool.model"]
    assert s["llamapool.lease_ending"] == "eof"
    assert s["gen_ai.usage.output_tokens"] == 6
    assert _attrs(span("frontend.prompt_gate"))["llamapool.prompt_tokens"] > 0
    wait = _attrs(span("frontend.slot_wait"))
    assert wait["llamapool.answer"] == "accepted"
    assert wait["llamapool.brokers_asked"] == 1
    stream = _attrs(span("frontend.stream"))
    assert stream["gen_ai.response.finish_reasons"] == ["length"]
    assert stream["llamapool.token_frames"] >= 1
    placement = _attrs(span("broker.placement"))
    assert placement["llamapool.placed"] is True and placement["llamapool.worker"]
    assert placement["llamapool.prefix_blocks"] >= 0
    assert "llamapool.prefix_blocks_held" in placement
    assert placement["llamapool.step_down_held"] is False
    plan = _attrs(span("worker.prompt_plan"))
    assert plan["llamapool.cold_tokens"] + plan["llamapool.cached_tokens"] == (
        plan["llamapool.prompt_tokens"])
    prefill = _attrs(span("worker.prefill"))
    assert prefill["llamapool.computed_tokens"] > 0
    decode = _attrs(span("worker.decode"))
    assert decode["llamapool.tokens"] == 6 and decode["llamapool.tokens_per_s"] > 0
    assert "llamapool.paused_for_credit_s" in decode
    assert [e.name for e in span("worker.job").events] == ["first_token"]

    # Never the prompt, in any byte any process exported.
    for needle in (PROMPT, "zebra-lighthouse"):
        assert not any(needle.encode() in raw for raw in receiver.raw)


def test_a_cancelled_stream_is_recorded_on_its_spans(traced_pool):
    pool, receiver = traced_pool
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    with httpx.Client(base_url=pool.url, timeout=60) as client, client.stream(
            "POST", "/v1/completions",
            headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            json={"prompt": "count", "max_tokens": 2000, "stream": True,
                  "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the first event; then the client is gone
    wait_until(lambda: {"broker.cancel", "worker.job", "frontend.stream"}
               <= set(receiver.of_trace(trace_id)), 30,
               "the cancelled job's spans at the receiver")
    spans = receiver.of_trace(trace_id)
    pool.assert_whole()
    cancel = _attrs(spans["broker.cancel"][1])
    assert spans["broker.cancel"][0] == "llamapool-broker"
    assert cancel["gen_ai.response.finish_reasons"] == ["cancelled"]
    worker = spans["worker.job"][1]
    assert _attrs(worker)["llamapool.cancelled"] is True
    assert "cancelled" in [e.name for e in worker.events]
    stream = _attrs(spans["frontend.stream"][1])
    assert stream["llamapool.lease_ending"] == "disconnect"


def test_an_unreachable_collector_costs_requests_nothing_and_one_line(pool_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed}",
           "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    with _pool_with(pool_factory, env) as pool, httpx.Client(
            base_url=pool.url, timeout=60) as client:
        def logs() -> str:
            return "\n".join(p.log_path.read_text(errors="replace")
                             for p in pool._procs())

        def ask() -> None:
            for _ in range(4):
                resp = client.post("/v1/completions",
                                   json={"prompt": "hi", "max_tokens": 2})
                assert resp.status_code == 200
                assert resp.headers["traceparent"].startswith("00-")

        ask()
        wait_until(lambda: "could not export" in logs(), 30,
                   "the failed export's log line")
        ask()
        wait_until(lambda: "could not export" in pool.broker.log_path.read_text(),
                   30, "the broker's failed export too")
        pool.assert_whole()
        text = logs()
    lines = [line for line in text.splitlines() if "could not export" in line]
    # At most one a minute per process: 2 gunicorn workers, broker, worker.
    assert 1 <= len(lines) <= 4, lines
    assert "Transient error" not in text and "Failed to export" not in text


def test_a_queued_job_has_its_wait_as_a_span(pool_factory):
    """With the broker's queue on, a job that finds the one slot busy waits:
    ``broker.queue_wait`` covers the wait, under ``frontend.job``, and ends
    when the slot frees, with the slot it got."""
    receiver = OtlpReceiver()
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    try:
        with _pool_with(pool_factory, _receiver_env(receiver),
                        broker_args=("--queue-max", "4", "--queue-timeout-s", "60")
                        ) as pool, httpx.Client(base_url=pool.url, timeout=60) as client:
            held, _ = hold_slot(pool)  # the one slot, paused for credit
            waiting = threading.Thread(target=lambda: client.post(
                "/v1/completions",
                headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
                json={"prompt": "wait", "max_tokens": 3}))
            waiting.start()
            wait_until(lambda: pool.status()["jobs_waiting"] == 1, 30,
                       "the second job waiting")
            held.close()
            waiting.join(60)
            assert not waiting.is_alive()
            # Every span read below: frontend.job ends last (with the
            # response), and may reach the receiver in a later export.
            wait_until(lambda: {"broker.queue_wait", "broker.placement",
                                "frontend.slot_wait", "worker.job", "frontend.job"}
                       <= set(receiver.of_trace(trace_id)),
                       30, "the queued job's spans at the receiver")
            spans = receiver.of_trace(trace_id)
            print("\n" + _tree(spans))
            pool.assert_whole()
    finally:
        receiver.stop()
    queue, job = spans["broker.queue_wait"][1], spans["frontend.job"][1]
    assert spans["broker.queue_wait"][0] == "llamapool-broker"
    assert queue.parent_span_id == job.span_id
    q = _attrs(queue)
    assert q["llamapool.queue_outcome"] == "started"
    assert q["llamapool.queue_position"] == 0 and q["llamapool.worker"]
    assert _attrs(spans["broker.placement"][1])["llamapool.queued"] is True
    wait = _attrs(spans["frontend.slot_wait"][1])
    assert wait["llamapool.queued"] is True and wait["llamapool.answer"] == "accepted"
    # The wait ended when the slot was handed over, before the job ran.
    assert queue.end_time_unix_nano <= spans["worker.job"][1].start_time_unix_nano
