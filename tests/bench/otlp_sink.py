"""An OTLP/HTTP traces endpoint for benchmarks: it takes what the SDK sends,
counts the spans (decoded with ``opentelemetry-proto``, so the export is
known to be real) and answers as a collector does, at once."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_REPLY = ExportTraceServiceResponse().SerializeToString()


class OtlpSink:
    """``with OtlpSink() as sink:`` serves ``sink.url`` until the block ends."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                n = sum(len(scope.spans) for rs in request.resource_spans
                        for scope in rs.scope_spans)
                with sink._lock:
                    sink.spans += n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(_REPLY)))
                self.end_headers()
                self.wfile.write(_REPLY)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="otlp-sink", daemon=True)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def env(self) -> dict[str, str]:
        """The variables that turn every llamapool process's tracing on, all
        requests sampled, exported here."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
                "OTEL_TRACES_SAMPLER": "always_on"}
