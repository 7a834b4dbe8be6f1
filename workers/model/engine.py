"""What a model worker needs from an engine, independent of llama.cpp.

The worker's socket side talks to an engine through ``JobSink`` (where output
goes, whether to stop) and gets back a ``GenerationResult``. Every engine
runs its units through the one loop of ``workers.model.token_loop``, and
supplies only how the next unit is made.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from protocol.errors import ErrorCode, context_exceeded_message
from protocol.messages import FinishReason
from protocol.payloads import (
    GenerationRequest,
    GpuPlacement,
    Timings,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:  # features.py imports this module's RequestRejected
    from workers.model.features import Feature


class RequestRejected(Exception):
    """The request cannot run (e.g. prompt longer than the context).

    Raised before any token is generated; becomes an ERROR frame carrying
    ``code``. The frontend decides the HTTP status from the code.
    """

    def __init__(self, code: ErrorCode, message: str, *,
                 n_prompt_tokens: int = 0, n_ctx: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        #: With ``CONTEXT_LENGTH_EXCEEDED``: the sizes llama.cpp's error names.
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    @classmethod
    def context_exceeded(cls, n_prompt_tokens: int, n_ctx: int,
                         exact: bool = True) -> RequestRejected:
        return cls(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                   context_exceeded_message(n_prompt_tokens, n_ctx, exact),
                   n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def token_budget(n_prompt: int, n_ctx: int, asked: int | None) -> int:
    """Tokens a request may generate; refuses a prompt that fills the context.

    An over-long ``max_tokens`` is clamped to the room left (finish "length"),
    as llama-cpp-python does; ``None`` means "until the context is full".
    """
    if n_prompt >= n_ctx:
        raise RequestRejected.context_exceeded(n_prompt, n_ctx)
    room = n_ctx - n_prompt
    return room if asked is None else min(asked, room)


class JobSink(Protocol):
    """The generation loop's view of the outside world."""

    def emit(self, text: str, n_tokens: int,
             logprobs: list[TokenLogprob] = (),
             timings: Timings | None = None, token_ids: bytes = b"") -> None:
        """Send output text covering ``n_tokens`` new tokens (and their
        log-probability entries, and the timings so far, if the request
        asked for them; and their packed ids, if the engine has them)."""

    def emit_embedding(self, vector: bytes, n_tokens: int) -> None:
        """Send one input's embedding (little-endian float32) of ``n_tokens``
        input tokens; an embedding job sends one per input, in order."""

    def should_stop(self) -> bool:
        """True once the job was cancelled; checked between tokens."""

    def wait_for_credit(self) -> bool:
        """Block until another frame may be sent. False: give up (stalled)."""

    def report_progress(self, n_prompt: int, n_generated: int,
                        max_tokens: int, tokens_per_s: float,
                        n_ctx_used: int) -> None:
        """Publish live progress for heartbeats (cheap, lock-free)."""

    def threads_to_use(self, current: int) -> int:
        """The thread count for the next decode, given the one in use
        (``--threads auto`` changes it while a job runs; else ``current``).
        Cheap: called between tokens."""


@dataclasses.dataclass
class GenerationResult:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_ms: float
    predicted_ms: float
    tail_text: str = ""  # held-back text released at the end
    #: Log-probability entries of the tail's tokens.
    tail_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    #: The stop string that ended generation ("" if none did).
    stopping_word: str = ""
    #: Generation stopped because the context was full (llama-server's
    #: ``truncated``), not at the request's own limit.
    truncated: bool = False
    #: Packed ids of the tokens counted after the last frame
    #: (``messages.Final.token_ids``).
    tail_token_ids: bytes = b""

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )

    def timings(self) -> Timings:
        per_s = (
            self.completion_tokens / (self.predicted_ms / 1000)
            if self.predicted_ms > 0
            else 0.0
        )
        # Clamped so that this worker's own FINAL always passes the range
        # checks at the broker (a clock step must not turn a job into an error).
        return Timings(
            prompt_n=max(0, self.prompt_tokens - self.cached_tokens),
            prompt_ms=max(0.0, self.prompt_ms),
            predicted_n=self.completion_tokens,
            predicted_ms=max(0.0, self.predicted_ms),
            predicted_per_second=per_s,
            cache_n=self.cached_tokens,
        )


class Engine(Protocol):
    name: str
    model_name: str
    n_ctx: int
    #: Where the model's layers are (``/slots``).
    gpu: GpuPlacement
    #: Whether llama.cpp repacked the weights, and why (``/slots``; "" for
    #: an engine without weights).
    repack: str
    #: What the engine can do (``workers.model.features``). The worker
    #: refuses a request that needs anything else before ``run`` sees it
    #: (``refuse_unsupported``), so ``run`` never checks for itself.
    features: frozenset[Feature]

    def warm_up(self) -> None:
        """Compute once before READY, with the settings jobs will use (a
        short prompt batch and a few decode steps), then forget it. Raises
        if the engine cannot compute; a native crash happens here instead
        of in a client's job."""

    def idle(self) -> bool:
        """Work for the time between jobs, when none waits (save the prompt
        state just finished); True if what ``prompt_cache_report`` says
        changed."""

    def prompt_cache_report(self) -> tuple[list[list[int]], object] | None:
        """What CACHE_REPORT carries (fingerprint lists, the cache's
        figures), or None for an engine without a prompt cache."""

    def run(self, request: GenerationRequest, sink: JobSink) -> GenerationResult:
        """Generate for one request. Raises ``RequestRejected`` up front.

        Sampling settings are read from ``request.sampling`` as they are:
        their defaults were applied when the request was built."""
