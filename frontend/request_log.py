"""One structured log line per request, and the per-request metrics.

A streamed request is not over when the responder returns: the body keeps
the lease until the client has read the last event. So a record completes
when both parts are done, the HTTP response (``process_response``) and, if a
job was started, its lease; whichever comes second writes the line.

Never logged: API keys (only their last 4 characters) and prompt or output
text.
"""

from __future__ import annotations

import logging
import threading
import time

from frontend import metrics
from frontend.job import JobOutcome
from frontend.lease import SlotLease

log = logging.getLogger("llamapool.request")


class RequestRecord:
    """What the request log line says about one request."""

    def __init__(self, request_id: str, method: str, endpoint: str) -> None:
        self.request_id = request_id
        self.method = method
        self.endpoint = endpoint
        #: The matched route's template (``/v1/completions``), or ``other``:
        #: the metrics label. The raw path is for the log line only, as a
        #: label it would let any client create series without end.
        self.route = "other"
        self.key_suffix = "-"
        self.started_at = time.monotonic()
        self.status: int | None = None
        self.slot_id: int | None = None
        #: The ``model`` label of its job's series (``frontend.metrics``):
        #: the pool's name for the model, set before the job is submitted.
        self.model = ""
        self.stream = False
        self.lease: SlotLease | None = None
        self.outcome: JobOutcome | None = None
        #: The request's span (``frontend.request_trace.RequestTrace``), ended
        #: with this record; None: not traced.
        self.trace = None
        self._parts_left = 1
        self._lock = threading.Lock()

    def expect_job(self) -> JobOutcome:
        """Called before a job is submitted: the record now also waits for the
        lease to end. Returns the outcome object the job will fill in."""
        with self._lock:
            self._parts_left += 1
        self.outcome = JobOutcome()
        metrics.STREAMS_OPEN.labels(self.model).inc()
        return self.outcome

    def lease_released(self, lease: SlotLease) -> None:
        """The lease's ``on_release`` hook; runs exactly once per lease."""
        self.lease = lease
        metrics.STREAMS_OPEN.labels(self.model).dec()
        metrics.LEASE_ENDINGS.labels(self.model, lease.ending.value).inc()
        metrics.SLOT_HOLD.labels(self.model).observe(
            lease.released_at - lease.taken_at)
        self._part_done()

    def response_done(self, status: int) -> None:
        self.status = status
        metrics.HTTP_RESPONSES.labels(self.route, str(status)).inc()
        self._part_done()

    def _part_done(self) -> None:
        with self._lock:
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        duration_s = time.monotonic() - self.started_at
        fields = {
            "request_id": self.request_id,
            "key": self.key_suffix,
            "method": self.method,
            "endpoint": self.endpoint,
            "status": self.status,
            "duration_ms": round(duration_s * 1000, 2),
        }
        o = self.outcome
        if o is not None and self.lease is not None:
            fields["slot_id"] = self.slot_id
            fields["stream"] = self.stream
            fields["ending"] = self.lease.ending.value
            fields["finish_reason"] = o.finish_reason
            fields["error_code"] = o.error_code
            if o.usage is not None:
                fields["prompt_tokens"] = o.usage.prompt_tokens
                fields["completion_tokens"] = o.usage.completion_tokens
            if o.first_token_at is not None:
                ttft = o.first_token_at - o.started_at
                fields["ttft_ms"] = round(ttft * 1000, 2)
                metrics.TIME_TO_FIRST_TOKEN.labels(self.model).observe(ttft)
            gaps = metrics.INTER_TOKEN_LATENCY.labels(self.model)
            for gap in o.inter_token_s:
                gaps.observe(gap)
            metrics.REQUEST_DURATION.labels(self.model).observe(duration_s)
        log.info(" ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
                 extra=fields)
        if self.trace is not None:
            self.trace.finish(self)


class RequestLogMiddleware:
    """Creates the record first and completes its HTTP part last."""

    def process_request(self, req, resp) -> None:
        req.context.record = RequestRecord(
            getattr(req.context, "request_id", "-"), req.method, req.path
        )

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        record = req.context.get("record")
        if record is None:
            return
        record.key_suffix = req.context.get("key_suffix", "-")
        # Set by falcon once a route matched; None for 404s and for requests
        # refused before routing (401).
        record.route = req.uri_template or "other"
        status = resp.status if isinstance(resp.status, int) else int(
            str(resp.status).split()[0])
        record.response_done(status)
