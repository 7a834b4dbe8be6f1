"""Domain errors and their one mapping to HTTP.

Two kinds of error reach a client. The frontend's own refusals of a request
(a malformed body, a missing key) are ``ApiError`` subclasses with their
status. Failures of the pool are named by a domain code
(``protocol.errors.ErrorCode``), whoever detected them, and ``HTTP_FORMS``
is the one table that says which HTTP status and OpenAI error type each code
gets: for an error answered before the headers (``PoolError``), for the 503
bodies of ``/health`` and ``/slots``, and for the error event that ends a
stream (``ResponseShaper.error_event``). Before, each producer sent its own
HTTP status on the wire and the SSE event always said ``server_error``.

Exceptions become HTTP responses in one place, ``install_error_handlers``.
Bodies follow OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; the 401 and 503 bodies match llama.cpp's server exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence

import falcon

from frontend import metrics
from protocol import messages
from protocol.errors import ErrorCode

log = logging.getLogger("llamapool.frontend")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "unavailable_error"
#: llama.cpp's type for what this server cannot do (its 501s).
NOT_SUPPORTED = "not_supported_error"
#: llama.cpp's type for a prompt that does not fit the context.
EXCEED_CONTEXT_SIZE = "exceed_context_size_error"


@dataclasses.dataclass(frozen=True)
class HttpForm:
    """How a domain code is shown to an HTTP client."""

    status: int
    type: str


#: The one table from domain code to HTTP. A 4xx says the client must change
#: the request; 502/504 that a part of the pool failed it; 503 that the pool
#: cannot serve now and a retry may succeed.
HTTP_FORMS: dict[ErrorCode, HttpForm] = {
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: HttpForm(400, EXCEED_CONTEXT_SIZE),
    ErrorCode.INVALID_PROMPT_TOKENS: HttpForm(400, INVALID_REQUEST),
    ErrorCode.INVALID_MESSAGES: HttpForm(400, INVALID_REQUEST),
    ErrorCode.INVALID_GRAMMAR: HttpForm(400, INVALID_REQUEST),
    ErrorCode.UNSUPPORTED_FIELD: HttpForm(400, INVALID_REQUEST),
    ErrorCode.TOOLS_UNSUPPORTED: HttpForm(400, INVALID_REQUEST),
    ErrorCode.INPUT_TOO_LARGE: HttpForm(400, INVALID_REQUEST),
    ErrorCode.DUPLICATE_JOB: HttpForm(400, INVALID_REQUEST),
    ErrorCode.INVALID_SLOT: HttpForm(400, INVALID_REQUEST),
    ErrorCode.INVALID_SLOT_FILE: HttpForm(400, INVALID_REQUEST),
    ErrorCode.SLOT_ACTIONS_UNSUPPORTED: HttpForm(501, NOT_SUPPORTED),
    ErrorCode.MODEL_NOT_FOUND: HttpForm(404, INVALID_REQUEST),
    ErrorCode.CLIENT_STALLED: HttpForm(408, INVALID_REQUEST),
    ErrorCode.ENGINE_ERROR: HttpForm(500, SERVER_ERROR),
    ErrorCode.WORKER_DIED: HttpForm(502, SERVER_ERROR),
    ErrorCode.WORKER_CRASHED: HttpForm(502, SERVER_ERROR),
    ErrorCode.WORKER_RESTARTED: HttpForm(502, SERVER_ERROR),
    ErrorCode.WORKER_PROTOCOL_ERROR: HttpForm(502, SERVER_ERROR),
    ErrorCode.UNREADABLE_JOB: HttpForm(502, SERVER_ERROR),
    ErrorCode.TIMEOUT: HttpForm(504, SERVER_ERROR),
    ErrorCode.WORKER_UNRESPONSIVE: HttpForm(504, SERVER_ERROR),
    ErrorCode.WORKER_SHUTDOWN: HttpForm(503, UNAVAILABLE),
    ErrorCode.WORKER_BUSY: HttpForm(503, UNAVAILABLE),
    ErrorCode.BROKER_UNREACHABLE: HttpForm(503, UNAVAILABLE),
    ErrorCode.BROKER_RESTARTED: HttpForm(503, UNAVAILABLE),
    ErrorCode.NO_SLOT: HttpForm(503, UNAVAILABLE),
    ErrorCode.LOADING_MODEL: HttpForm(503, UNAVAILABLE),
    ErrorCode.WORKERS_FAILING: HttpForm(503, UNAVAILABLE),
}

#: A code this frontend does not know (a newer peer's): a plain server error.
UNKNOWN_FORM = HttpForm(500, SERVER_ERROR)


def http_form(code: str) -> HttpForm:
    """The HTTP status and error type for a domain code."""
    return HTTP_FORMS.get(code, UNKNOWN_FORM)


class ApiError(Exception):
    """An error the client should see as it is."""

    status = 500
    type = "server_error"
    code: str | int | None = None
    #: Label for ``llamapool_requests_rejected_total``; None: not a rejection.
    reject_reason: str | None = None

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type}
        if self.param is not None:
            error["param"] = self.param
        if self.code is not None:
            error["code"] = self.code
        return {"error": error}


class BadRequest(ApiError):
    status = 400
    reject_reason = "bad_request"
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    reject_reason = "too_large"
    type = "invalid_request_error"
    code = "request_too_large"


class Unauthorized(ApiError):
    status = 401
    reject_reason = "auth"
    type = "authentication_error"

    def __init__(self) -> None:
        super().__init__("Invalid API Key")


class OriginNotAllowed(ApiError):
    """A browser request from a page whose origin may not use the pool
    (``frontend.cors.OriginCheckMiddleware``)."""

    status = 403
    reject_reason = "origin"
    type = "permission_error"
    code = "origin_not_allowed"

    def __init__(self, origin: str) -> None:
        super().__init__(
            f"web pages from {origin[:200]!r} may not use this pool: allow the "
            "origin with --cors-origins (LLAMAPOOL_CORS_ORIGINS)")


class MisdirectedRequest(ApiError):
    """A request addressed to a host name the pool does not serve
    (``frontend.cors.HostCheckMiddleware``): HTTP 421."""

    status = 421
    reject_reason = "host"
    type = "invalid_request_error"
    code = "misdirected_request"

    def __init__(self, host: str) -> None:
        super().__init__(
            f"this pool does not answer to the host name {host[:200]!r}: add "
            "it to --allowed-hosts (LLAMAPOOL_ALLOWED_HOSTS)")


class ClientGone(ApiError):
    """The client closed its connection before its job was started: no
    slot is taken and nothing is submitted (``frontend.client_socket``).
    Nobody reads the answer; nginx's 499 names it in logs."""

    status = 499
    reject_reason = "client_gone"
    type = "invalid_request_error"
    code = "client_gone"

    def __init__(self) -> None:
        super().__init__("the client closed the connection")


class ClientLeft(ClientGone):
    """The client closed its connection while its job ran (a non-streamed
    answer): the job was cancelled. Not a refusal: its lease says
    ``disconnect``, as a stream's does."""

    reject_reason = None


class PoolError(ApiError):
    """A failure of the pool, named by its domain code; status and type come
    from ``HTTP_FORMS``. The body's ``code`` is that name."""

    #: llama.cpp's shape: the body's ``code`` is the HTTP status, not the name.
    code_is_status = False

    def __init__(self, code: str, message: str) -> None:
        form = http_form(code)
        super().__init__(
            message, code=form.status if self.code_is_status else str(code)
        )
        self.domain_code = code
        self.status = form.status
        self.type = form.type


class UpstreamError(PoolError):
    """A job that failed before any output was sent: the client gets a real
    HTTP status instead of a stream."""

    @classmethod
    def from_frame(cls, msg: messages.Error) -> UpstreamError:
        if msg.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED:
            return ContextSizeExceeded(msg.message, msg.n_prompt_tokens,
                                       msg.n_ctx)
        return cls(msg.code, msg.message)


class ContextSizeExceeded(UpstreamError):
    """A prompt longer than the context, refused by the frontend's gate or by
    a worker: llama.cpp's body, ``type: exceed_context_size_error`` with
    ``n_prompt_tokens`` and ``n_ctx`` (OpenAI's ``code`` is kept)."""

    reject_reason = "bad_request"

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int,
                 param: str | None = None) -> None:
        super().__init__(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.param = param

    def body(self) -> dict:
        body = super().body()
        body["error"]["n_prompt_tokens"] = self.n_prompt_tokens
        body["error"]["n_ctx"] = self.n_ctx
        return body


class Unavailable(PoolError):
    """The pool cannot serve right now, answered as llama.cpp answers its 503s
    (``{"code": 503, "message", "type": "unavailable_error"}``)."""

    code_is_status = True


class NoSlotAvailable(Unavailable):
    reject_reason = "no_slot"

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(ErrorCode.NO_SLOT, "no slot available")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, int(round(self.retry_after_s))))}


class RateLimitExceeded(ApiError):
    """A named key over one of its limits (the broker's RATE_LIMITED,
    ``frontend.key_records``): 429, with Retry-After and OpenAI's
    ``x-ratelimit-*`` headers. "requests" there counts the key's jobs running
    (or waiting) at once, "tokens" its tokens in a minute. The pool being
    full stays 503."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    reject_reason = "rate_limit"

    _WHAT = {"slots": "jobs running at once", "queued": "jobs waiting at once",
             "tokens": "tokens per minute"}

    def __init__(self, answer: messages.RateLimited) -> None:
        super().__init__(f"this key is over its limit of {answer.limit} "
                         f"{self._WHAT[answer.reason]}; retry after "
                         f"{_whole_seconds(answer.reset_s)} s")
        self.answer = answer

    def headers(self) -> dict[str, str]:
        a = self.answer
        unit = "tokens" if a.reason == "tokens" else "requests"
        reset = _whole_seconds(a.reset_s)
        return {"Retry-After": str(reset),
                f"x-ratelimit-limit-{unit}": str(a.limit),
                f"x-ratelimit-remaining-{unit}": str(a.remaining),
                f"x-ratelimit-reset-{unit}": f"{reset}s"}


def _whole_seconds(seconds: float) -> int:
    return max(1, int(round(seconds)))


#: An API family's own error shape: the status and body it answers an
#: ``ApiError`` with (Anthropic's ``{"type": "error", ...}`` and its 529, in
#: ``frontend.anthropic_format``). The table and the errors stay these.
ErrorShape = Callable[[ApiError], tuple[int, dict]]


def write_error(resp: falcon.Response, error: ApiError,
                shape: ErrorShape | None = None) -> None:
    """Answer with ``error``: for the handlers below, and for responders that
    answer an error without raising (the ledger views); in ``shape`` if the
    request's API family has one."""
    status, body = (error.status, error.body()) if shape is None else shape(error)
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(body)
    for name, value in error.headers().items():
        resp.set_header(name, value)


def install_error_handlers(app: falcon.App, refused_model: str = "",
                           shapes: Sequence[tuple[str, ErrorShape]] = ()) -> None:
    """The single place where exceptions become HTTP responses.

    ``refused_model`` labels the no-slot refusals
    (``metrics.REQUESTS_REFUSED_NO_SLOT``) of a request that resolved no
    model (``RequestRecord.model``: no catalog to resolve it in). ``shapes``: (path prefix, shape)
    of the API families that answer errors in their own shape; a request
    under such a prefix gets its errors so, a 401 or 404 included.
    """
    def shape_of(req) -> ErrorShape | None:
        return next((shape for prefix, shape in shapes
                     if req.path == prefix or req.path.startswith(prefix + "/")),
                    None)

    # The series exists at 0 from the start, so rate() sees the first
    # refusal as an increase rather than as a new series.
    metrics.REQUESTS_REFUSED_NO_SLOT.labels(refused_model)

    def on_api_error(req, resp, ex: ApiError, params) -> None:
        if ex.reject_reason is not None:
            metrics.REQUESTS_REJECTED.labels(ex.reject_reason).inc()
        if isinstance(ex, NoSlotAvailable):
            # The model the request resolved to (``RequestRecord.model``).
            record = req.context.get("record")
            metrics.REQUESTS_REFUSED_NO_SLOT.labels(
                getattr(record, "model", "") or refused_model).inc()
        write_error(resp, ex, shape_of(req))

    def on_falcon_error(req, resp, ex: falcon.HTTPError, params) -> None:
        # Falcon's own errors (404, 405, ...) in the same OpenAI shape.
        error = ApiError(ex.title + (f": {ex.description}" if ex.description else ""))
        error.status = ex.status_code
        error.type = "invalid_request_error" if ex.status_code < 500 else "server_error"
        write_error(resp, error, shape_of(req))
        for name, value in (ex.headers or {}).items():
            resp.set_header(name, value)

    def on_unexpected(req, resp, ex: Exception, params) -> None:
        log.exception(
            "unhandled error in request %s", getattr(req.context, "request_id", "-")
        )
        write_error(resp, ApiError("internal server error"), shape_of(req))

    # Falcon picks the most specific handler, regardless of order.
    app.add_error_handler(Exception, on_unexpected)
    app.add_error_handler(falcon.HTTPError, on_falcon_error)
    app.add_error_handler(ApiError, on_api_error)
