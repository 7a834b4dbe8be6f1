"""A stand-in engine with no model: fixed-rate, deterministic tokens.

``llamapool worker --engine synthetic --tokens-per-second R`` serves with this
instead of llama.cpp, so the broker, the frontend and the load generator can
be measured and tested without the cost (or the noise) of a real model.
It is not a model and never pretends to be one: READY says engine
``synthetic`` and ``/v1/models`` and ``/slots`` show it.

It keeps every promise a real engine keeps to the worker, through the same
loop (``workers.model.token_loop``): ``max_tokens`` and the context size,
stop strings that never leak, credit before each frame, a cancel check
between tokens, and live progress. It has no ``features``: the worker
refuses a request that needs a grammar, log-probabilities, a logit bias,
tools or embeddings before this engine sees it. Output token ``i`` is the
text ``tok{i}``, separated by spaces: ``"tok0 tok1 tok2"``.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator

from protocol import defaults
from protocol.payloads import CHAT, GenerationRequest, GpuPlacement
from workers.model.engine import GenerationResult, JobSink, token_budget
from workers.model.token_loop import TokenLoop

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
    features = frozenset()  # no model, no logits (workers.model.features)

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
        # No model, no logits: what needs them was refused before this
        # (``features``, checked by the worker).
        started = time.perf_counter()
        n_prompt = count_prompt_tokens(request)
        max_tokens = token_budget(n_prompt, self.n_ctx, request.max_tokens)
        loop = TokenLoop(sink, started=started, n_prompt=n_prompt,
                         max_tokens=max_tokens,
                         stops=request.stop + request.extra_stops,
                         timings_per_token=request.timings_per_token,
                         rate_since_start=True)
        finish = loop.run(self._paced(started), functools.partial(_take, n_prompt))
        return loop.result(finish)

    def _paced(self, started: float) -> Iterator[int]:
        """Token indices, each due ``1 / tokens_per_second`` after the last."""
        interval_s = 1.0 / self.tokens_per_second
        for index in itertools.count():
            # Pace against the start, not the previous token, so the rate
            # holds on average even when a sleep overshoots.
            delay = started + (index + 1) * interval_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            yield index


def _take(n_prompt: int, index: int) -> tuple[str, None, int]:
    """Token ``index``'s text, with no log-probability entry, and the context
    in use once it is counted."""
    return token_text(index), None, n_prompt + index + 1
