"""Where the frontend's spans hook in; each hook is one attribute read when off.

The spans themselves are ``frontend.request_trace``'s, imported only once
tracing is on (``protocol.tracing``), so a frontend without an OTLP
endpoint never imports OpenTelemetry and makes no span object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from protocol import tracing
from protocol.payloads import GenerationRequest

T = TypeVar("T")


def middleware() -> list:
    """The request-span middleware, or none when tracing is off."""
    if tracing.TRACER is None:
        return []
    from frontend.request_trace import TracingMiddleware
    return [TracingMiddleware()]


def traced_auth(auth: Any) -> Any:
    """The key check, in a span of its own when tracing is on."""
    if tracing.TRACER is None:
        return auth
    from frontend.request_trace import TracedAuth
    return TracedAuth(auth)


def traced_parse(parse: Callable[[Any], T], body: Any) -> T:
    """``parse(body)``, in the request's ``frontend.parse`` span when on."""
    if tracing.TRACER is None:
        return parse(body)
    from frontend.request_trace import in_step
    return in_step("frontend.parse", parse, body)


def traced_gate_check(gate: Any, generation: GenerationRequest) -> GenerationRequest:
    """``gate.check(generation)``, in a ``frontend.prompt_gate`` span that
    says how many tokens the prompt has, when on."""
    if tracing.TRACER is None:
        return gate.check(generation)
    from frontend.request_trace import gate_step
    return gate_step(gate, generation)


def job_trace(id_slot: int) -> Any:
    """The spans of one try of a job (``request_trace.JobTrace``), or None."""
    if tracing.TRACER is None:
        return None
    from frontend.request_trace import JobTrace, traced
    return JobTrace(id_slot) if traced() else None
