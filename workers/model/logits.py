"""What a request does to the raw logits before llama.cpp samples: logit bias,
``ignore_eos``, log-probabilities, the grammar; in that order.

llama-cpp-python runs a ``LogitsProcessorList`` as the first sampler of its
chain, on the raw logits (index = token id). Log-probabilities are read there,
before any bias, so they are the model's own distribution (as
llama-cpp-python's ``logprobs`` are); the grammar comes last so that it sees
every ban, and its dead-end check covers them all.

Bias and bans alone (no grammar, no bias of ``-inf`` that could ban every
token) go to llama.cpp's own logit-bias sampler instead, right after the
processors (``workers.model.native_bias``): the same change, without a
Python call on the whole vocabulary per token.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
import numpy as np

from protocol.payloads import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    LogitBias,
    TokenCandidate,
    TokenLogprob,
)
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.grammar import GrammarConstraint

#: Most distinct tokens one request may bias (a text key may stand for many).
MAX_BIASED_TOKENS = 4096


class BiasError(ValueError):
    """A ``logit_bias`` entry names no token of this vocabulary."""


def resolve_bias(entries: list[LogitBias], n_vocab: int,
                 tokenize) -> dict[int, float]:
    """Token id -> bias (``-inf`` for never), as llama.cpp's server reads
    ``logit_bias``: a text stands for each of its tokens; a later entry for
    the same token wins."""
    out: dict[int, float] = {}
    for entry in entries:
        if entry.token is not None:
            if not 0 <= entry.token < n_vocab:
                raise BiasError(f"logit_bias: token {entry.token} is not in the "
                                f"vocabulary (0..{n_vocab - 1})")
            ids = [entry.token]
        else:
            ids = tokenize(entry.piece)
        for token in ids:
            out[token] = -np.inf if entry.never else entry.bias
        if len(out) > MAX_BIASED_TOKENS:
            raise BiasError(f"logit_bias covers more than {MAX_BIASED_TOKENS} "
                            "tokens")
    return out


class LogprobRecorder:
    """Keeps the log-softmax of the raw logits at each step, so that the token
    sampled from them can be looked up once it is known."""

    def __init__(self, n_top: int, vocab: ctypes.c_void_p) -> None:
        self.n_top = max(0, min(n_top, MAX_TOP_LOGPROBS))
        self._detok = IncrementalDetokenizer(vocab)
        self._last: np.ndarray | None = None

    def __call__(self, input_ids: Any, scores: np.ndarray) -> np.ndarray:
        logits = scores.astype(np.float64)
        top = logits.max()
        self._last = logits - (top + np.log(np.exp(logits - top).sum()))
        return scores

    def _candidate(self, token: int) -> TokenCandidate:
        logprob = float(self._last[token])
        # exp underflow: finite, and as unlikely as a float says.
        logprob = logprob if np.isfinite(logprob) else -1e30
        return TokenCandidate(token, self._detok.piece(token), logprob)

    def entry(self, token: int) -> TokenLogprob:
        """The entry for ``token``, sampled from the last logits seen."""
        chosen = self._candidate(token)
        top: list[TokenCandidate] = []
        if self.n_top:
            n = min(self.n_top, len(self._last))
            best = np.argpartition(-self._last, n - 1)[:n]
            best = best[np.argsort(-self._last[best], kind="stable")]
            top = [self._candidate(int(t)) for t in best]
        return TokenLogprob(chosen.id, chosen.piece, chosen.logprob, top)


class RequestLogits:
    """The processors one request needs, built from it; empty if none.

    Raises:
        BiasError: a bias names no token.
        GrammarError: the grammar does not compile with this vocabulary.
    """

    def __init__(self, request: GenerationRequest, *, vocab: ctypes.c_void_p,
                 n_vocab: int, eog_ids: list[int], tokenize) -> None:
        self.processors: list = []
        self.grammar: GrammarConstraint | None = None
        self.logprobs: LogprobRecorder | None = None
        #: Token id -> bias for llama.cpp's logit-bias sampler (``-inf``:
        #: banned); empty when the processors apply them.
        self.native_bias: dict[int, float] = {}
        self._eog_ids = eog_ids
        if request.logprobs is not None:
            self.logprobs = LogprobRecorder(request.logprobs, vocab)
            self.processors.append(self.logprobs)
        bias = resolve_bias(request.sampling.logit_bias, n_vocab, tokenize)
        if not request.grammar and not any(math.isinf(b) for b in bias.values()):
            # Nothing needs to see the bias applied (the grammar's dead-end
            # check, the never-empty guard): llama.cpp applies it, after the
            # processors, as llama-server applies logit_bias and ignore_eos.
            self.native_bias = dict(bias)
            if request.sampling.ignore_eos:
                self.native_bias.update(dict.fromkeys(eog_ids, -np.inf))
            return
        if bias:
            self._bias_ids = np.fromiter(bias, dtype=np.int64)
            self._bias = np.fromiter(bias.values(), dtype=np.float32)
            self.processors.append(self._apply_bias)
        if request.sampling.ignore_eos and eog_ids:
            self.processors.append(self._ban_eog)
        if request.grammar:
            self.grammar = GrammarConstraint(request.grammar, vocab, n_vocab, eog_ids)
            self.processors.append(self.grammar.mask)
        elif any(math.isinf(b) for b in bias.values()):
            # Bans alone can leave no token: end generation, never sample from
            # nothing (NaN probabilities in llama.cpp's samplers). Banning the
            # end tokens alone (ignore_eos) cannot.
            self.processors.append(self._never_empty)

    def processor_list(self) -> llama_cpp.LogitsProcessorList | None:
        return llama_cpp.LogitsProcessorList(self.processors) if self.processors \
            else None

    def _apply_bias(self, input_ids: Any, scores: np.ndarray) -> np.ndarray:
        scores[self._bias_ids] += self._bias
        return scores

    def _ban_eog(self, input_ids: Any, scores: np.ndarray) -> np.ndarray:
        scores[self._eog_ids] = -np.inf
        return scores

    def _never_empty(self, input_ids: Any, scores: np.ndarray) -> np.ndarray:
        if not np.isfinite(scores).any():
            scores[self._eog_ids or [0]] = 0.0
        return scores

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
