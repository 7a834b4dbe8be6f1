"""The one token loop every engine runs.

An engine makes units: the llama.cpp engine sampled tokens, the synthetic
engine paced stand-in tokens, an embedding job one pooled vector per input.
A ``TokenLoop`` runs them through everything a job shares, whatever makes
them: the clock (time to the first unit, then generation time), the token
budget, credit before each frame (``TokenOutput``, ``VectorOutput``), live
progress for heartbeats (the broker's Retry-After and ``/slots`` read it), a
cancel check between units, and the ``GenerationResult``.

The engine supplies only what is its own, to ``TokenLoop.run``:

- ``units``: an iterator whose ``next`` makes the next unit (a decode and a
  sample, a paced sleep, an embedding decode);
- ``take(unit)``: what the unit means: the two arguments of its output's
  ``push`` and the context in use (for the progress report), or the finish
  reason that ends the job before it counts (an end-of-generation token, a
  grammar with nothing left to allow);
- ``between(sink)``, optionally: work between two units (the llama engine
  follows the thread budget there).

The loop is the llama engine's hot path: per unit it reads the clock once,
right after the unit is made (so a stalled client's credit wait never counts
as prompt time), and calls no more than it must.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from protocol.messages import FinishReason, pack_token_ids
from protocol.payloads import Timings, TokenLogprob
from workers.model.engine import GenerationResult, JobSink
from workers.model.stop_strings import StopStringFilter

U = TypeVar("U")


class LiveTimings:
    """A job's timings so far, for the TOKEN frames of a request that asked
    for them on every token (llama.cpp's ``timings_per_token``).

    Measured as ``GenerationResult.timings`` measures the whole job: prompt
    time from the start to the first sampled token, generation time from
    there to now.
    """

    def __init__(self, started: float, n_prompt: int, n_cached: int) -> None:
        self._started = started
        self._prompt_n = max(0, n_prompt - n_cached)
        self._cache_n = n_cached
        self._first_token_at: float | None = None

    def now(self, n_generated: int) -> Timings:
        at = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = at
        predicted_ms = max(0.0, (at - self._first_token_at) * 1000)
        return Timings(
            prompt_n=self._prompt_n,
            prompt_ms=max(0.0, (self._first_token_at - self._started) * 1000),
            predicted_n=n_generated,
            predicted_ms=predicted_ms,
            predicted_per_second=(n_generated / predicted_ms * 1000
                                  if predicted_ms > 0 else 0.0),
            cache_n=self._cache_n,
        )


class TokenOutput:
    """The output side of a text job.

    Each new token's text goes through the stop-string filter; what is safe to
    show waits for credit and goes out as one frame covering every token since
    the last frame sent. With ``timings``, each frame also carries the job's
    timings so far; with ``token_ids``, the ids of the tokens it covers.
    """

    def __init__(self, sink: JobSink, stops: list[str],
                 timings: LiveTimings | None = None,
                 token_ids: bool = False) -> None:
        self.sink = sink
        self.stopper = StopStringFilter(stops)
        self._timings = timings
        #: Tokens pushed so far (each counts, even the one a stop ends on).
        self.n_pushed = 0
        self._unsent_tokens = 0
        #: Log-probability entries of the tokens not sent yet.
        self._unsent_logprobs: list[TokenLogprob] = []
        #: Ids of the tokens not sent yet (None: the engine has no ids).
        self._unsent_ids: list[int] | None = [] if token_ids else None

    def push(self, text: str, logprob: TokenLogprob | None = None,
             token: Any = None) -> FinishReason | None:
        """Account one token; return a finish reason if generation must end.

        ``logprob`` (when the request asked for them) goes out with the frame
        that carries the token's text. A frame that ends at a stop string
        carries the entries of every token up to it; tokens held back and
        then dropped by a stop string have none. ``token`` is the token's id
        (kept with ``token_ids``): every counted token's id goes out, those
        of a stop string's tokens too, as llama-server streams them.
        """
        self.n_pushed += 1
        self._unsent_tokens += 1
        if logprob is not None:
            self._unsent_logprobs.append(logprob)
        if self._unsent_ids is not None:
            self._unsent_ids.append(token)
        if self._timings is not None and self.n_pushed == 1:
            self._timings.now(0)  # the first token ends the prompt's time
        text = self.stopper.push(text)
        if text:
            if not self.sink.wait_for_credit():
                return FinishReason.CANCELLED
            extra = {}
            if self._timings is not None:
                extra["timings"] = self._timings.now(self.n_pushed)
            if self._unsent_logprobs:
                extra["logprobs"] = self._unsent_logprobs
                self._unsent_logprobs = []
            if self._unsent_ids:
                extra["token_ids"] = pack_token_ids(self._unsent_ids)
                self._unsent_ids = []
            self.sink.emit(text, self._unsent_tokens, **extra)
            self._unsent_tokens = 0
        return FinishReason.STOP if self.stopper.stopped else None

    def tail(self, last_text: str = "") -> str:
        """Text held back until the end (a stop-string prefix that never
        completed, plus ``last_text``)."""
        return self.stopper.push(last_text) + self.stopper.flush()

    def tail_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens whose text ``tail`` released."""
        out, self._unsent_logprobs = self._unsent_logprobs, []
        return [] if self.stopper.stopped else out

    def tail_token_ids(self) -> bytes:
        """The packed ids of the tokens counted after the last frame."""
        out, self._unsent_ids = self._unsent_ids, []
        return pack_token_ids(out) if out else b""


class VectorOutput:
    """The output side of an embedding job: one frame per input, each after
    credit."""

    def __init__(self, sink: JobSink) -> None:
        self.sink = sink
        #: Input tokens of the vectors sent (one that got no credit does
        #: not count).
        self.n_pushed = 0

    def push(self, vector: bytes, n_tokens: int, unit: Any = None
             ) -> FinishReason | None:
        """Send one input's vector (``n_tokens`` tokens); CANCELLED if the
        client gave no credit. ``unit`` (the loop passes every unit) is the
        input itself, already in ``vector``."""
        if not self.sink.wait_for_credit():
            return FinishReason.CANCELLED
        self.sink.emit_embedding(vector, n_tokens)
        self.n_pushed += n_tokens
        return None


def cancelled_while_tokenizing(started: float) -> GenerationResult:
    """The result of a job cancelled before its loop began (its prompt was
    still being tokenised): no tokens, its time all prompt time."""
    return GenerationResult(
        finish_reason=FinishReason.CANCELLED, prompt_tokens=0,
        completion_tokens=0, cached_tokens=0,
        prompt_ms=(time.perf_counter() - started) * 1000, predicted_ms=0.0)


class TokenLoop:
    """One job's loop: the clock, the budget, progress, cancel, and its
    result. As it stands, for text: each unit is a token, sent through a
    ``TokenOutput`` (``EmbeddingLoop`` changes what a unit is).

    Args:
        sink: the job's sink.
        started: ``time.perf_counter()`` when the job began (before its
            prompt was tokenised).
        n_prompt: prompt tokens (progress, usage).
        max_tokens: units the job may count (``engine.token_budget``).
        stops: the stop strings.
        cached_tokens: prompt tokens served from the KV cache.
        timings_per_token: frames carry the timings so far.
        rate_since_start: the progress rate counts from the job's start (an
            engine with no prompt phase of its own), not from the first unit.
        context_limited: ``max_tokens`` is the room the context had left, so
            reaching it means the context is full (``truncated``).
        token_ids: the units are token ids, and the frames carry them.
    """

    #: How a job ends that reached its budget.
    budget_finish = FinishReason.LENGTH
    #: Whether cancel is checked before the first unit is made too.
    check_cancel_first = False

    def __init__(self, sink: JobSink, *, started: float, n_prompt: int,
                 max_tokens: int, stops: Sequence[str] = (), cached_tokens: int = 0,
                 timings_per_token: bool = False,
                 rate_since_start: bool = False,
                 context_limited: bool = False,
                 token_ids: bool = False) -> None:
        self.sink = sink
        self.context_limited = context_limited
        self.started = started
        self.n_prompt = n_prompt
        self.max_tokens = max_tokens
        self.cached_tokens = cached_tokens
        self.rate_since_start = rate_since_start
        live = (LiveTimings(started, n_prompt, cached_tokens)
                if timings_per_token else None)
        self.output: TokenOutput | VectorOutput = TokenOutput(
            sink, list(stops), live, token_ids)
        #: When the first unit was made (or the job found it had no budget).
        self.first_token_at: float | None = None

    def run(self, units: Iterable[U], take: Callable[[U], Any],
            between: Callable[[JobSink], None] | None = None) -> FinishReason:
        """Run ``units`` until one of the job's ends; return how it ended.

        ``take(unit)`` returns a tuple ``(data, extra, n_ctx_used)``:
        ``self.output.push(data, extra, unit)`` sends the unit, and the progress
        report after it says ``n_ctx_used``. Or it returns a
        ``FinishReason`` to end before the unit counts.
        """
        sink, output = self.sink, self.output
        report, should_stop = sink.report_progress, sink.should_stop
        n_prompt, max_tokens = self.n_prompt, self.max_tokens
        rate_origin = self.started if self.rate_since_start else None
        if max_tokens <= 0:
            self.first_token_at = time.perf_counter()
            return self.budget_finish
        if self.check_cancel_first and should_stop():
            return FinishReason.CANCELLED
        clock = time.perf_counter
        first = None
        for unit in units:
            now = clock()
            if first is None:
                first = self.first_token_at = now
                if rate_origin is None:
                    rate_origin = now
            piece = take(unit)
            if piece.__class__ is not tuple:
                return piece  # ended before this unit counts
            data, extra, n_ctx_used = piece
            ended_by = output.push(data, extra, unit)
            if ended_by is not None:
                return ended_by
            n = output.n_pushed
            elapsed = now - rate_origin
            report(n_prompt, n, max_tokens, n / elapsed if elapsed > 0 else 0.0,
                   n_ctx_used)
            if n >= max_tokens:
                return self.budget_finish
            if should_stop():
                return FinishReason.CANCELLED
            if between is not None:
                between(sink)
        return self.budget_finish

    def result(self, finish: FinishReason, last_text: str = "") -> GenerationResult:
        """The job's result: usage, timings (prompt time until the first
        unit, generation time after it), and what was held back until the
        end (``last_text`` after it; nothing of a cancelled job)."""
        ended = time.perf_counter()
        first = self.first_token_at or ended
        output = self.output
        cancelled = finish == FinishReason.CANCELLED
        return GenerationResult(
            finish_reason=finish,
            prompt_tokens=self.n_prompt,
            completion_tokens=output.n_pushed,
            cached_tokens=self.cached_tokens,
            prompt_ms=(first - self.started) * 1000,
            predicted_ms=(ended - first) * 1000,
            tail_text="" if cancelled else output.tail(last_text),
            tail_logprobs=[] if cancelled else output.tail_logprobs(),
            stopping_word=output.stopper.matched,
            truncated=self.context_limited and finish == FinishReason.LENGTH,
            tail_token_ids=b"" if cancelled else output.tail_token_ids(),
        )


class EmbeddingLoop(TokenLoop):
    """The loop of an embedding job: its units are inputs, each counting its
    tokens, and they are all prompt. It checks cancel before the first input
    as before every other, ends STOP once every input is sent, and its rate
    counts from the start (input tokens embedded stand for tokens generated,
    so that the broker's Retry-After, remaining / speed, counts this job
    too).
    """

    budget_finish = FinishReason.STOP
    check_cancel_first = True

    def __init__(self, sink: JobSink, *, started: float, n_tokens: int) -> None:
        super().__init__(sink, started=started, n_prompt=n_tokens,
                         max_tokens=n_tokens, rate_since_start=True)
        self.output = VectorOutput(sink)

    def result(self, finish: FinishReason, last_text: str = "") -> GenerationResult:
        """Usage and timings of the inputs embedded: all prompt."""
        return GenerationResult(
            finish_reason=finish, prompt_tokens=self.output.n_pushed,
            completion_tokens=0, cached_tokens=0,
            prompt_ms=(time.perf_counter() - self.started) * 1000,
            predicted_ms=0.0)
