"""What a model worker needs from an engine, independent of llama.cpp.

The worker's socket side talks to an engine through ``JobSink`` (where output
goes, whether to stop) and gets back a ``GenerationResult``. The generation
loop itself lives in the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class RequestRejected(Exception):
    """The request cannot run (e.g. prompt longer than the context).

    Raised before any token is generated; becomes an ERROR frame carrying
    ``status`` so the frontend can answer with that HTTP status.
    """

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


class JobSink(Protocol):
    """The generation loop's view of the outside world."""

    def emit(self, text: str, n_tokens: int) -> None:
        """Send output text covering ``n_tokens`` new tokens."""

    def should_stop(self) -> bool:
        """True once the job was cancelled; checked between tokens."""

    def wait_for_credit(self) -> bool:
        """Block until another frame may be sent. False: give up (stalled)."""

    def report_progress(self, n_prompt: int, n_generated: int,
                        max_tokens: int, tokens_per_s: float,
                        n_ctx_used: int) -> None:
        """Publish live progress for heartbeats (cheap, lock-free)."""


@dataclasses.dataclass
class GenerationResult:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_ms: float
    predicted_ms: float
    tail_text: str = ""  # held-back text released at the end

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def timings(self) -> dict:
        per_s = (
            self.completion_tokens / (self.predicted_ms / 1000)
            if self.predicted_ms > 0
            else 0.0
        )
        return {
            "prompt_n": self.prompt_tokens - self.cached_tokens,
            "prompt_ms": self.prompt_ms,
            "predicted_n": self.completion_tokens,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": per_s,
        }


class Engine(Protocol):
    name: str
    model_name: str
    n_ctx: int

    def run(self, request: dict, sink: JobSink) -> GenerationResult:
        """Generate for one request. Raises ``RequestRejected`` up front."""
