"""Domain errors and their one mapping to HTTP (``install_error_handlers``).

Bodies follow OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; the 401 and 503 bodies match llama.cpp's server exactly.
"""

from __future__ import annotations

import json
import logging

import falcon

from frontend import metrics

log = logging.getLogger("llamapool.frontend")


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


class NoSlotAvailable(ApiError):
    status = 503
    reject_reason = "no_slot"
    type = "unavailable_error"
    code = 503

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("no slot available")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, int(round(self.retry_after_s))))}


class Unavailable(ApiError):
    """The pool cannot serve right now (broker unreachable, no worker, ...)."""

    status = 503
    type = "unavailable_error"
    code = 503


class UpstreamError(ApiError):
    """A worker-side failure reported before any output was sent."""

    type = "server_error"

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.status = status
        if 400 <= status < 500:
            self.type = "invalid_request_error"
        elif status == 503:
            self.type = "unavailable_error"


def _write(resp: falcon.Response, error: ApiError) -> None:
    resp.status = error.status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(error.body())
    for name, value in error.headers().items():
        resp.set_header(name, value)


def install_error_handlers(app: falcon.App) -> None:
    """The single place where exceptions become HTTP responses."""

    def on_api_error(req, resp, ex: ApiError, params) -> None:
        if ex.reject_reason is not None:
            metrics.REQUESTS_REJECTED.labels(ex.reject_reason).inc()
        _write(resp, ex)

    def on_falcon_error(req, resp, ex: falcon.HTTPError, params) -> None:
        # Falcon's own errors (404, 405, ...) in the same OpenAI shape.
        error = ApiError(ex.title + (f": {ex.description}" if ex.description else ""))
        error.status = ex.status_code
        error.type = "invalid_request_error" if ex.status_code < 500 else "server_error"
        _write(resp, error)
        for name, value in (ex.headers or {}).items():
            resp.set_header(name, value)

    def on_unexpected(req, resp, ex: Exception, params) -> None:
        log.exception(
            "unhandled error in request %s", getattr(req.context, "request_id", "-")
        )
        _write(resp, ApiError("internal server error"))

    # Falcon picks the most specific handler, regardless of order.
    app.add_error_handler(Exception, on_unexpected)
    app.add_error_handler(falcon.HTTPError, on_falcon_error)
    app.add_error_handler(ApiError, on_api_error)
