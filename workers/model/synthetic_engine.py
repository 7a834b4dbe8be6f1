"""A stand-in engine with no model: fixed-rate, deterministic tokens.

``llamapool worker --engine synthetic --tokens-per-second R`` serves with this
instead of llama.cpp, so the broker, the frontend and the load generator can
be measured and tested without the cost (or the noise) of a real model.
It is not a model and never pretends to be one: READY says engine
``synthetic`` and ``/v1/models`` and ``/slots`` show it.

It keeps every promise a real engine keeps to the worker: ``max_tokens``
and the context size, stop strings that never leak
(``workers.model.stop_strings``), credit before each frame, a cancel check between
tokens, and live progress. Output token ``i`` is the text ``tok{i}``,
separated by spaces: ``"tok0 tok1 tok2"``.
"""

from __future__ import annotations

import time

from protocol import defaults
from protocol.errors import ErrorCode
from protocol.messages import FinishReason
from protocol.payloads import CHAT, EMBEDDING, GenerationRequest, GpuPlacement
from workers.model.engine import (
    GenerationResult,
    JobSink,
    LiveTimings,
    RequestRejected,
    TokenOutput,
    token_budget,
)

DEFAULT_TOKENS_PER_SECOND = 50.0


def count_prompt_tokens(request: GenerationRequest) -> int:
    """Tokens from the frontend's tokeniser if it sent them, else words."""
    if request.prompt_tokens:
        return len(request.prompt_tokens)
    if request.kind == CHAT:
        words = sum(len(m.content.split()) for m in request.messages)
    else:
        words = len(request.prompt.split())
    return max(1, words)  # a real model always sees at least BOS


def token_text(index: int) -> str:
    """The deterministic text of output token ``index``."""
    return f"tok{index}" if index == 0 else f" tok{index}"


class SyntheticEngine:
    """Emits ``tok0 tok1 ...`` at ``tokens_per_second``, one job at a time."""

    name = "synthetic"

    def __init__(
        self,
        *,
        tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND,
        n_ctx: int = defaults.N_CTX,
        model_name: str | None = None,
    ) -> None:
        if tokens_per_second <= 0:
            raise ValueError("tokens_per_second must be positive")
        self.tokens_per_second = tokens_per_second
        self.n_ctx = n_ctx
        self.model_name = model_name or "synthetic"
        self.gpu = GpuPlacement()  # no model, no layers
        self.repack = ""

    def warm_up(self) -> None:
        """Nothing to prove: there is no model and no native code."""

    def idle(self) -> bool:
        return False  # no prompt cache: nothing to save between jobs

    def prompt_cache_report(self) -> None:
        return None

    def run(self, request: GenerationRequest, sink: JobSink) -> GenerationResult:
        # No model, no logits: refuse what needs them rather than ignore it.
        for field, given in (("grammar", request.grammar),
                             ("logprobs", request.logprobs is not None),
                             ("logit_bias", request.sampling.logit_bias),
                             ("tools", request.tools),
                             ("embeddings", request.kind == EMBEDDING)):
            if given:
                raise RequestRejected(ErrorCode.UNSUPPORTED_FIELD,
                                      f"the synthetic engine has no {field}")
        started = time.perf_counter()
        n_prompt = count_prompt_tokens(request)
        max_tokens = token_budget(n_prompt, self.n_ctx, request.max_tokens)
        live = (LiveTimings(started, n_prompt, 0)
                if request.timings_per_token else None)
        output = TokenOutput(sink, request.stop + request.extra_stops, live)
        interval_s = 1.0 / self.tokens_per_second

        n_generated = 0
        finish = FinishReason.LENGTH
        while n_generated < max_tokens:
            # Pace against the start, not the previous token, so the rate
            # holds on average even when a sleep overshoots.
            due = started + (n_generated + 1) * interval_s
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            n_generated += 1
            ended_by = output.push(token_text(n_generated - 1))
            if ended_by is not None:
                finish = ended_by
                break
            elapsed = time.perf_counter() - started
            sink.report_progress(
                n_prompt, n_generated, max_tokens,
                n_generated / elapsed if elapsed > 0 else 0.0,
                n_prompt + n_generated,
            )
            if sink.should_stop():
                finish = FinishReason.CANCELLED
                break
        ended = time.perf_counter()
        first_token_s = min(interval_s, ended - started) if n_generated else 0.0
        return GenerationResult(
            finish_reason=finish,
            prompt_tokens=n_prompt,
            completion_tokens=n_generated,
            cached_tokens=0,
            prompt_ms=first_token_s * 1000,
            predicted_ms=(ended - started - first_token_s) * 1000,
            tail_text="" if finish == FinishReason.CANCELLED else output.tail(),
            stopping_word=output.stopper.matched,
        )
