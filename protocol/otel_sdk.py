"""The OpenTelemetry SDK, set up for one process; imported only when tracing is on.

``start`` builds the tracer provider the standard way: the sampler from
``OTEL_TRACES_SAMPLER``, a batch span processor (``OTEL_BSP_*``) so that no
request thread, broker loop or token loop ever waits on an export, and the
OTLP exporter over HTTP/protobuf or gRPC (``OTEL_EXPORTER_OTLP_*``). An
unreachable collector costs the batch processor's thread its retries and
the log one throttled line a minute: the exporter's own lines (one per
retry) are silenced for it.

The rest are the calls the three packages' span helpers share: the W3C
codec between a span and SUBMIT's ``TraceContext``, and the clock that turns
a ``time.monotonic`` or ``time.perf_counter`` reading into a span timestamp
(spans measured in the hot path are made afterwards, from readings the code
takes anyway).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import (
    TraceContextTextMapPropagator,
)

from protocol import limits
from protocol.log_throttle import LogThrottle
from protocol.payloads import TraceContext

log = logging.getLogger("llamapool.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()

#: One line per window about failed exports, whatever the batch rate.
EXPORT_FAILURE_LOG_WINDOW_S = 60.0


def start(service_name: str, environ: Mapping[str, str]) -> trace.Tracer | None:
    """This process's tracer, exporting to the configured collector; None
    (and a log line) when the configured protocol cannot be served."""
    exporter = _exporter(environ)
    if exporter is None:
        return None
    provider = TracerProvider(resource=_resource(service_name))
    provider.add_span_processor(BatchSpanProcessor(
        ThrottledExporter(exporter, _endpoint_shown(environ))))
    log.info("tracing on: %s exports to %s", service_name,
             _endpoint_shown(environ))
    return provider.get_tracer("llamapool")


def _resource(service_name: str) -> Resource:
    resource = Resource.create({"process.pid": os.getpid(),
                                "host.name": socket.gethostname()})
    named = str(resource.attributes.get("service.name", ""))
    if not named or named.startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    return resource


def _exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    # One throttled line of ours instead of the exporter's line per retry.
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            log.error("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs "
                      "opentelemetry-exporter-otlp-proto-grpc; tracing is off")
            return None
        return GrpcSpanExporter()
    log.error("OTLP protocol %r is not supported (http/protobuf or grpc); "
              "tracing is off", protocol[:40])
    return None


def _endpoint_shown(environ: Mapping[str, str]) -> str:
    """The collector's address for log lines, without any user:password."""
    url = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
           or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    parts = urlsplit(url)
    if not parts.hostname:
        return url[:200]
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


class ThrottledExporter(SpanExporter):
    """An exporter whose failures are logged at most once per window."""

    def __init__(self, inner: SpanExporter, where: str) -> None:
        self._inner = inner
        self._where = where
        self._throttle = LogThrottle(log, burst=1,
                                     window_s=EXPORT_FAILURE_LOG_WINDOW_S)
        self.failed_batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # the batch thread must go on
            result = SpanExportResult.FAILURE
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            why = "the collector did not take them"
        if result is not SpanExportResult.SUCCESS:
            self.failed_batches += 1
            self._throttle.warning(
                "export failed", "could not export %d spans to %s (%s); they "
                "are dropped", len(spans), self._where, why)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


# --- the context in SUBMIT ----------------------------------------------------------


def context_of(span: trace.Span) -> TraceContext:
    """``span``'s W3C context, for SUBMIT."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    state = carrier.get("tracestate", "")
    return TraceContext(carrier.get("traceparent", ""),
                        state if len(state) <= limits.MAX_TRACESTATE_CHARS else "")


def parent_context(headers: Mapping[str, str]) -> Context | None:
    """The context that ``traceparent``/``tracestate`` headers (or SUBMIT's
    fields, in the same shape) name; None if they name no valid span."""
    ctx = _PROPAGATOR.extract(headers)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def job_parent(trace_context: TraceContext | None) -> Context | None:
    """The frontend's span that a SUBMIT names, when it was sampled; None:
    this job makes no spans here (the frontend's sampler decided)."""
    if trace_context is None:
        return None
    carrier = {"traceparent": trace_context.traceparent}
    if trace_context.tracestate:
        carrier["tracestate"] = trace_context.tracestate
    ctx = parent_context(carrier)
    if ctx is None:
        return None
    sampled = trace.get_current_span(ctx).get_span_context().trace_flags.sampled
    return ctx if sampled else None


# --- clocks ---------------------------------------------------------------------------


def wall_ns(reading: float, clock: Callable[[], float] = time.monotonic) -> int:
    """A span timestamp (epoch nanoseconds) for ``reading``, a value that
    ``clock`` returned earlier in this process."""
    return time.time_ns() - int((clock() - reading) * 1e9)
