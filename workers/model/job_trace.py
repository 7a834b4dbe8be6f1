"""The worker's spans of a traced job, made from what the job measures anyway.

Children of the frontend's ``frontend.job`` span (``messages.Submit.trace``)::

    worker.job                 (its ending: finish reason, or the error)
    ├── worker.prompt_plan     (live prefix reused, state restored and its
    │                           size, tokens left cold)
    ├── worker.prefill         (prompt tokens computed, and the time to the
    │                           first token; event first_token)
    └── worker.decode          (tokens, tokens/s, paused for credit)

Nothing is recorded per token: the token loop stays as it is, and the spans
are built when the job ends, from the FINAL frame's timings (the clock the
engine keeps: prompt time up to the first token, generation time after it),
the prompt plan's note (``note_plan``), and the job's pauses for credit
(``ActiveJob.paused_s``). A cancelled job or an error is recorded on
``worker.job``.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from protocol import messages, otel_sdk, tracing
from workers.model.active_job import ActiveJob


class WorkerJobTrace:
    """One traced job's spans on this worker."""

    def __init__(self, job: ActiveJob, parent: Context) -> None:
        self.job = job
        self._started_perf = time.perf_counter()
        self._started_ns = time.time_ns()
        self.span: trace.Span = tracing.TRACER.start_span(
            "worker.job", context=parent, start_time=self._started_ns,
            attributes={"llamapool.job_id": job.job_id,
                        "llamapool.request_kind": job.request.kind})
        self._ctx = trace.set_span_in_context(self.span)
        self._plan: tuple[float, float, dict[str, Any]] | None = None
        #: Bytes of the prompt state restored for this job (0: none).
        self.restored_bytes = 0

    @classmethod
    def start(cls, job: ActiveJob) -> WorkerJobTrace | None:
        parent = otel_sdk.job_parent(job.trace_context)
        return None if parent is None else cls(job, parent)

    def note_plan(self, started_perf: float, *, live: int, restored: int,
                  cached: int, prompt: int) -> None:
        """What ``PromptReuse.prepare`` decided, and since when it ran."""
        self._plan = (started_perf, time.perf_counter(), {
            "llamapool.prompt_tokens": prompt,
            "llamapool.live_prefix_tokens": live,
            "llamapool.restored_tokens": restored,
            "llamapool.restored_bytes": self.restored_bytes,
            "llamapool.cached_tokens": cached,
            "llamapool.cold_tokens": prompt - cached,
        })

    def end(self, msg: messages.Message) -> None:
        """The job's terminal frame is about to go: end its spans."""
        end_ns = time.time_ns()
        if isinstance(msg, messages.Final):
            self._phases(msg, end_ns)
            self.span.set_attributes({
                "gen_ai.response.finish_reasons": (msg.finish_reason,),
                "gen_ai.usage.input_tokens": msg.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": msg.usage.completion_tokens,
                "llamapool.cached_tokens": msg.usage.cached_tokens,
            })
            if msg.finish_reason == messages.FinishReason.CANCELLED:
                self.span.add_event("cancelled", timestamp=end_ns)
                self.span.set_attribute("llamapool.cancelled", True)
        else:
            code = str(getattr(msg, "code", "unknown"))
            self.span.set_attribute("error.type", code)
            self.span.set_status(Status(StatusCode.ERROR, code))
        self.span.end(end_time=end_ns)

    def _wall(self, perf: float) -> int:
        return self._started_ns + int((perf - self._started_perf) * 1e9)

    def _phases(self, final: messages.Final, end_ns: int) -> None:
        tracer, timings = tracing.TRACER, final.timings
        prefill_from = self._started_ns
        if self._plan is not None:
            started, ended, attrs = self._plan
            prefill_from = self._wall(ended)
            tracer.start_span("worker.prompt_plan", context=self._ctx,
                              start_time=self._wall(started),
                              attributes=attrs).end(end_time=prefill_from)
        first_ns = min(end_ns, self._started_ns + int(timings.prompt_ms * 1e6))
        prefill_from = min(prefill_from, first_ns)
        tracer.start_span("worker.prefill", context=self._ctx,
                          start_time=prefill_from, attributes={
                              "llamapool.prompt_tokens": final.usage.prompt_tokens,
                              "llamapool.computed_tokens": timings.prompt_n,
                              "llamapool.cached_tokens": timings.cache_n,
                              "llamapool.prompt_ms": timings.prompt_ms,
                          }).end(end_time=first_ns)
        if final.usage.completion_tokens:
            self.span.add_event("first_token", timestamp=first_ns)
        self.span.set_attribute("llamapool.first_token_ms", timings.prompt_ms)
        job = self.job
        tracer.start_span("worker.decode", context=self._ctx, start_time=first_ns,
                          attributes={
                              "llamapool.tokens": timings.predicted_n,
                              "llamapool.tokens_per_s": round(
                                  final.timings.public()["predicted_per_second"], 3),
                              "llamapool.paused_for_credit_s": round(job.paused_s, 6),
                              "llamapool.credit_pauses": job.pauses,
                          }).end(end_time=end_ns)
