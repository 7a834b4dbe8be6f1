"""The frontend's spans: the HTTP request, its steps, and each try of its job.

Imported only when tracing is on (``frontend.tracing``). One request::

    POST /v1/chat/completions        (SERVER; the client's traceparent, if any)
    ├── frontend.auth
    ├── frontend.parse
    ├── frontend.prompt_gate         (tokens counted)
    └── frontend.job                 (SUBMIT carries this span's context)
        ├── frontend.slot_wait       (SUBMIT to ACCEPTED / NO_SLOT)
        ├── frontend.first_frame     (ACCEPTED to the worker's first frame)
        └── frontend.stream          (first frame to the lease's end)

The broker's and the worker's spans are children of ``frontend.job``. The
request's span ends with its log record (``frontend.request_log``), that is
when both the response and the lease are over. No span carries prompt or
output text, nor any part of a key: the attributes are counts, names the
pool chose (route, model, finish reason, how the lease ended) and ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from frontend.interfaces import FrameStream, JobOrigin
from frontend.job import JobOutcome
from frontend.lease import SlotLease
from protocol import limits, messages, otel_sdk, tracing
from protocol.payloads import GenerationRequest

#: Longest path put on a span (a client may send any path).
_MAX_PATH_CHARS = 256


class RequestTrace:
    """The HTTP request's span, ended by ``finish`` with the request's record."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.token: object | None = None

    def finish(self, record: Any) -> None:
        """End the span with what the request log says (``RequestRecord``)."""
        span = self.span
        span.update_name(f"{record.method} {record.route}")
        attrs: dict[str, Any] = {"http.route": record.route,
                                 "llamapool.stream": record.stream}
        if record.status is not None:
            attrs["http.response.status_code"] = record.status
            if record.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        if record.slot_id is not None:
            attrs["llamapool.slot_id"] = record.slot_id
        if record.lease is not None:
            attrs["llamapool.lease_ending"] = record.lease.ending.value
        outcome = record.outcome
        if outcome is not None:
            attrs.update(_outcome_attributes(outcome))
            if outcome.first_token_at is not None:
                attrs["llamapool.ttft_ms"] = round(
                    (outcome.first_token_at - outcome.started_at) * 1000, 3)
        span.set_attributes(attrs)
        span.end()


def excluded_paths(environ: Mapping[str, str] = os.environ) -> re.Pattern:
    """The paths not traced: ``OTEL_PYTHON_EXCLUDED_URLS`` (comma-separated
    regular expressions, searched in the path, as OpenTelemetry's Python
    instrumentations read it), else the probes and scrapes that would
    otherwise be most of the traces."""
    given = (environ.get("OTEL_PYTHON_FALCON_EXCLUDED_URLS")
             or environ.get("OTEL_PYTHON_EXCLUDED_URLS"))
    patterns = ([p.strip() for p in given.split(",") if p.strip()] if given
                else DEFAULT_EXCLUDED_PATHS)
    return re.compile("|".join(f"(?:{p})" for p in patterns) or "(?!)")


#: Not traced unless ``OTEL_PYTHON_EXCLUDED_URLS`` says otherwise: health
#: checks and metric scrapes, many a second and each the same.
DEFAULT_EXCLUDED_PATHS = ["^/health$", "^/v1/health$", "^/livez$", "^/readyz$",
                          "^/metrics$"]


def traced() -> bool:
    """Whether this thread's request has a recording span (its steps and
    jobs get spans only then: never a trace of their own)."""
    return trace.get_current_span().is_recording()


class TracingMiddleware:
    """Starts the request's span (continuing the client's ``traceparent``),
    makes it current for the request's own steps, and answers with the
    ``traceparent`` of the request's span."""

    def __init__(self) -> None:
        self._excluded = excluded_paths()

    def process_request(self, req, resp) -> None:
        if self._excluded.search(req.path):
            return
        headers = {}
        for name in ("traceparent", "tracestate"):
            value = req.get_header(name)
            if value:
                headers[name] = value[:limits.MAX_TRACESTATE_CHARS]
        parent = otel_sdk.parent_context(headers) if headers else None
        span = tracing.TRACER.start_span(
            req.method, context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": req.method,
                        "url.path": req.path[:_MAX_PATH_CHARS],
                        "llamapool.request_id": getattr(req.context,
                                                        "request_id", "-")})
        request_trace = RequestTrace(span)
        record = req.context.get("record")
        if record is not None:
            record.trace = request_trace
        req.context.trace = request_trace
        request_trace.token = otel_context.attach(trace.set_span_in_context(span))
        resp.set_header("traceparent", otel_sdk.context_of(span).traceparent)

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        request_trace = req.context.get("trace")
        if request_trace is not None and request_trace.token is not None:
            otel_context.detach(request_trace.token)
            request_trace.token = None
        if req.context.get("record") is None and request_trace is not None:
            request_trace.span.end()  # nothing else would end it


class TracedAuth:
    """The key check (``frontend.auth.ApiKeyMiddleware``) in a span: whether
    the request had to show a key, and whether it passed. No part of the key."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def process_request(self, req, resp) -> None:
        if not traced():
            self.inner.process_request(req, resp)
            return
        with tracing.TRACER.start_as_current_span(
                "frontend.auth", record_exception=False,
                set_status_on_exception=False) as span:
            try:
                self.inner.process_request(req, resp)
            except Exception:
                span.set_attribute("llamapool.auth.result", "refused")
                raise
            shown = req.context.get("key_suffix", "-") != "-"
            span.set_attribute("llamapool.auth.result",
                               "accepted" if shown else "not_required")


@contextlib.contextmanager
def _step(name: str) -> Iterator[trace.Span]:
    """A child span of the request's. An error is named by its type only: a
    parser's message may quote the client's body."""
    with tracing.TRACER.start_as_current_span(
            name, record_exception=False, set_status_on_exception=False) as span:
        try:
            yield span
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise


def in_step(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the step's span, if the request is traced."""
    if not traced():
        return fn(*args)
    with _step(name):
        return fn(*args)


def gate_step(gate: Any, generation: GenerationRequest) -> GenerationRequest:
    """The prompt gate's check in its span, with the tokens it counted."""
    if not traced():
        return gate.check(generation)
    with _step("frontend.prompt_gate") as span:
        checked = gate.check(generation)
        if checked.prompt_tokens is not None:
            span.set_attribute("llamapool.prompt_tokens", len(checked.prompt_tokens))
        return checked


class JobTrace:
    """The spans of one try of a job, from SUBMIT to the lease's end."""

    def __init__(self, id_slot: int) -> None:
        tracer = tracing.TRACER
        self.request_span = trace.get_current_span()
        self.span = tracer.start_span("frontend.job",
                                      attributes={"llamapool.id_slot": id_slot})
        self._ctx = trace.set_span_in_context(self.span)
        self._phase: trace.Span | None = tracer.start_span(
            "frontend.slot_wait", context=self._ctx)

    def origin(self, origin: JobOrigin | None, job_id: str) -> JobOrigin:
        """``origin`` with this job's trace context, for SUBMIT."""
        self.span.set_attribute("llamapool.job_id", job_id)
        return dataclasses.replace(origin or JobOrigin(),
                                   trace=otel_sdk.context_of(self.span))

    def answered(self, answer: messages.Message | None, stream: FrameStream,
                 queued: messages.Queued | None = None) -> None:
        """The broker's answer to SUBMIT ends the slot wait (``queued``: the
        broker's last QUEUED, if the job waited in its queue)."""
        attrs: dict[str, Any] = {
            "llamapool.brokers_asked": getattr(stream, "brokers_asked", 1)}
        attrs["llamapool.queued"] = queued is not None
        if queued is not None:
            attrs["llamapool.queue_position"] = queued.position
        if isinstance(answer, messages.Accepted):
            attrs["llamapool.answer"] = "accepted"
            attrs["llamapool.slot_id"] = answer.slot_id
            for span in (self.span, self.request_span):
                span.set_attribute("llamapool.model", answer.model)
        elif isinstance(answer, messages.NoSlot):
            attrs["llamapool.answer"] = "no_slot"
            attrs["llamapool.retry_after_s"] = answer.retry_after_s
        elif isinstance(answer, messages.Error):
            attrs["llamapool.answer"] = "error"
            attrs["error.type"] = str(answer.code)
        else:
            attrs["llamapool.answer"] = "none"
        self._next_phase(attrs, "frontend.first_frame"
                         if isinstance(answer, messages.Accepted) else None)

    def first_frame(self, frame: messages.Message) -> None:
        """The worker's first frame ends the first-frame wait."""
        kind = type(frame).__name__.lower()
        attrs: dict[str, Any] = {"llamapool.frame": kind}
        if isinstance(frame, messages.Error):
            attrs["error.type"] = str(frame.code)
        self._next_phase(attrs, None if isinstance(frame, messages.Error)
                         else "frontend.stream")

    def releasing(self, on_release: Callable[[SlotLease], None] | None,
                  outcome: JobOutcome) -> Callable[[SlotLease], None]:
        """The lease's ``on_release``: end this try's spans, then ``on_release``."""
        def released(lease: SlotLease) -> None:
            self._released(lease, outcome)
            if on_release is not None:
                on_release(lease)
        return released

    def _next_phase(self, attrs: dict[str, Any], name: str | None) -> None:
        phase = self._phase
        if phase is not None:
            phase.set_attributes(attrs)
            phase.end()
        self._phase = (None if name is None else
                       tracing.TRACER.start_span(name, context=self._ctx))

    def _released(self, lease: SlotLease, outcome: JobOutcome) -> None:
        attrs = {"llamapool.lease_ending": lease.ending.value,
                 **_outcome_attributes(outcome)}
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.set_attributes(attrs)
            phase.end()
        if outcome.error_code is not None:
            self.span.set_status(Status(StatusCode.ERROR, outcome.error_code))
        self.span.set_attributes(attrs)
        self.span.end()


def _outcome_attributes(outcome: JobOutcome) -> dict[str, Any]:
    """How a job ended and what it cost: counts and the pool's own names."""
    attrs: dict[str, Any] = {
        "llamapool.token_frames": len(outcome.inter_token_s)
        + (outcome.first_token_at is not None)}
    if outcome.finish_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = (outcome.finish_reason,)
    if outcome.error_code is not None:
        attrs["error.type"] = outcome.error_code
    if outcome.usage is not None:
        attrs["gen_ai.usage.input_tokens"] = outcome.usage.prompt_tokens
        attrs["gen_ai.usage.output_tokens"] = outcome.usage.completion_tokens
        attrs["llamapool.cached_tokens"] = outcome.usage.cached_tokens
    return attrs
