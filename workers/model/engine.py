"""What a model worker needs from an engine, independent of llama.cpp.

The worker's socket side talks to an engine through ``JobSink`` (where output
goes, whether to stop) and gets back a ``GenerationResult``. The generation
loop itself lives in the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest, Timings, TokenLogprob, Usage
from workers.model.stop_strings import StopStringFilter


class RequestRejected(Exception):
    """The request cannot run (e.g. prompt longer than the context).

    Raised before any token is generated; becomes an ERROR frame carrying
    ``code``. The frontend decides the HTTP status from the code.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def token_budget(n_prompt: int, n_ctx: int, asked: int | None) -> int:
    """Tokens a request may generate; refuses a prompt that fills the context.

    An over-long ``max_tokens`` is clamped to the room left (finish "length"),
    as llama-cpp-python does; ``None`` means "until the context is full".
    """
    if n_prompt >= n_ctx:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {n_prompt} tokens; the context holds {n_ctx}",
        )
    room = n_ctx - n_prompt
    return room if asked is None else min(asked, room)


class TokenOutput:
    """The output side of a generation loop, shared by every engine.

    Each new token's text goes through the stop-string filter; what is safe to
    show waits for credit and goes out as one frame covering every token since
    the last frame sent.
    """

    def __init__(self, sink: JobSink, stops: list[str]) -> None:
        self.sink = sink
        self.stopper = StopStringFilter(stops)
        self._unsent_tokens = 0
        #: Log-probability entries of the tokens not sent yet.
        self._unsent_logprobs: list[TokenLogprob] = []

    def push(self, text: str, logprob: TokenLogprob | None = None) -> str | None:
        """Account one token; return a finish reason if generation must end.

        ``logprob`` (when the request asked for them) goes out with the frame
        that carries the token's text. A frame that ends at a stop string
        carries the entries of every token up to it; tokens held back and
        then dropped by a stop string have none.
        """
        self._unsent_tokens += 1
        if logprob is not None:
            self._unsent_logprobs.append(logprob)
        text = self.stopper.push(text)
        if text:
            if not self.sink.wait_for_credit():
                return "cancelled"
            if self._unsent_logprobs:
                self.sink.emit(text, self._unsent_tokens,
                               logprobs=self._unsent_logprobs)
                self._unsent_logprobs = []
            else:
                self.sink.emit(text, self._unsent_tokens)
            self._unsent_tokens = 0
        return "stop" if self.stopper.stopped else None

    def tail(self, last_text: str = "") -> str:
        """Text held back until the end (a stop-string prefix that never
        completed, plus ``last_text``)."""
        return self.stopper.push(last_text) + self.stopper.flush()

    def tail_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens whose text ``tail`` released."""
        out, self._unsent_logprobs = self._unsent_logprobs, []
        return [] if self.stopper.stopped else out


class JobSink(Protocol):
    """The generation loop's view of the outside world."""

    def emit(self, text: str, n_tokens: int,
             logprobs: list[TokenLogprob] = ()) -> None:
        """Send output text covering ``n_tokens`` new tokens (and their
        log-probability entries, if the request asked for them)."""

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
    #: Log-probability entries of the tail's tokens.
    tail_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    #: The stop string that ended generation ("" if none did).
    stopping_word: str = ""

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
        )


class Engine(Protocol):
    name: str
    model_name: str
    n_ctx: int

    def run(self, request: GenerationRequest, sink: JobSink) -> GenerationResult:
        """Generate for one request. Raises ``RequestRejected`` up front.

        Sampling settings are read from ``request.sampling`` as they are:
        their defaults were applied when the request was built."""
