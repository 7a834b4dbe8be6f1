"""Whether this process exports traces (OpenTelemetry), decided once at start.

One request is one trace across the three processes: the frontend starts it
(or continues the client's W3C ``traceparent``), SUBMIT carries the context
of its span for the job (``protocol.payloads.TraceContext``), and the
broker's and the worker's spans are children of that span. A job whose
SUBMIT has no context is not traced anywhere.

Tracing is on when the standard OpenTelemetry variables name an OTLP
endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and do not turn the SDK off
(``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none``): the per-process
switch operators already know. The rest of the SDK's variables (sampler,
batch processor, headers, timeout, protocol) work as the SDK documents them.

Off, it costs one attribute read per hook (``TRACER is None``): the
OpenTelemetry packages are never imported, and no span object is made. The
SDK is set up by ``protocol.otel_sdk``, imported only by ``configure``, and
each package's span helpers import it only once tracing is on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("llamapool.tracing")

#: This process's ``opentelemetry.trace.Tracer``; None: tracing is off.
TRACER: Any = None

#: ``service.name`` by process, unless ``OTEL_SERVICE_NAME`` (or
#: ``OTEL_RESOURCE_ATTRIBUTES``) names one.
SERVICE_NAMES = {
    "frontend": "llamapool-frontend",
    "broker": "llamapool-broker",
    "worker": "llamapool-worker",
}


def export_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """True if the OTEL_* variables ask for OTLP trace export."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    if "otlp" not in [e.strip() for e in exporters.split(",")]:
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())


def configure(role: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Start exporting this process's spans if the variables ask for it.

    Call it once per process, after any fork (the batch processor owns a
    thread). ``role`` is ``frontend``, ``broker`` or ``worker``. Returns
    whether tracing is on.
    """
    global TRACER
    if TRACER is not None:
        return True
    if not export_configured(environ):
        return False
    try:
        from protocol import otel_sdk
    except ImportError as exc:
        log.warning("an OTLP endpoint is configured but OpenTelemetry is not "
                    "installed (pip install 'llamapool[tracing]'): %s; tracing "
                    "is off", exc)
        return False
    TRACER = otel_sdk.start(SERVICE_NAMES[role], environ)
    return TRACER is not None
