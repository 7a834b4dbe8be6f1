"""Sampling from a shortlist of the logits, where that provably picks the
token the whole vocabulary would.

``llama_sampler_sample`` copies every logit into a candidate (262,144 of them
for Gemma 3) before the chain's top-k keeps k: on the CPU that is most of
the 0.5-0.9 ms a token's sampling costs, in series with the decode
(docs/benchmarks/31-sampling-and-a-a-runs.md). llama-server pays the same.

For a chain whose first real choice is top-k (or greedy), the tokens far
below the k-th best logit cannot matter: top-k never keeps them.
``ShortlistSampler`` picks a threshold (a few logits below the last step's
k-th best, or below this step's best), hands the chain only the tokens at
or above it (plus any token the logit bias moves), and lets the very same
chain (bias, penalties, top-k, typical, top-p, min-p, temperature, the
seeded draw) run on those. The token, and the chain's state after it, are
the full path's whenever:

- the shortlist holds at least k tokens at or above its threshold, after
  the bias; every token left out is below it, so top-k keeps the same set;
- the k + 1 best values on the shortlist are distinct (top-k only: its
  partial sort orders equal logits by where they sit in the array, which a
  shortlist changes); greedy takes the first best in id order, as the
  shortlist keeps them.

A NaN logit is never shortlisted (it compares false); llama.cpp's sort of
one is undefined, so there the two paths may differ, and only there. A
step that looks for the best logit and finds it NaN or infinite falls back.

These rest on how the vendored llama.cpp's samplers treat a candidate
array (top-k's partial sort, the logit-bias sampler's search by id);
``tests/test_shortlist_sampling.py`` compares the two paths token by
token, so a llama.cpp that changes them fails there.

Otherwise, and for every chain whose first choice sees the whole
vocabulary (Python logits processors: log-probabilities, a grammar, bans
that could leave nothing; repetition penalties; mirostat; top-k off; a
bias on too many tokens), it samples as llama.cpp does.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from typing import Any

import llama_cpp
import numpy as np

#: The largest top-k sampled from a shortlist; beyond it the shortlist
#: would be a large part of the vocabulary anyway.
MAX_SHORTLIST_K = 1024
#: The most biased tokens a shortlisted chain may carry: llama.cpp's
#: logit-bias sampler searches a shortlist for each one.
MAX_SHORTLIST_BIAS = 64
#: The margin below the best logit of a step's first shortlist (in
#: logits). On Gemma 3 it holds a few hundred to a few thousand tokens; a
#: step with fewer than k above it doubles it.
FIRST_MARGIN = 12.0
#: Doublings of the margin before the step falls back to the full path.
MAX_WIDENINGS = 2
#: How far below the last step's k-th best logit the next step's shortlist
#: starts. On Gemma 3 the k-th best moves by a few logits from one token to
#: the next: 4 gives a few hundred tokens, and misses one step in ten.
NEXT_SLACK = 4.0
#: The longest shortlist taken from that guess; a longer one is made
#: again from the best logit.
MAX_GUESSED = 8192

#: ``llama_token_data`` as NumPy lays it out.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)],
                       align=True)
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def shortlist_k(sampling: Mapping[str, Any], n_biased: int) -> int | None:
    """How many tokens a chain keeps first (1 for greedy), or None where its
    first choice needs the whole vocabulary. ``sampling``: the arguments of
    llama-cpp-python's ``Llama._init_sampler``, its defaults filled in;
    ``n_biased``: the tokens llama.cpp's logit-bias sampler changes."""
    if (sampling["logits_processor"] or sampling["grammar"] is not None
            or sampling["mirostat_mode"]):
        return None
    if (sampling["repeat_penalty"] != 1.0 or sampling["frequency_penalty"] != 0.0
            or sampling["presence_penalty"] != 0.0):
        return None
    if n_biased > MAX_SHORTLIST_BIAS:
        return None
    temp, top_k = sampling["temp"], sampling["top_k"]
    if temp == 0.0:
        return 1
    if temp > 0.0 and 0 < top_k <= MAX_SHORTLIST_K:
        return top_k
    return None


class ShortlistSampler:
    """A llama-cpp-python sampler chain (its ``LlamaSampler``, owned) that
    samples from a shortlist where ``k`` (``shortlist_k``) allows.

    ``sample`` stands in for the chain's own (``Llama.generate`` calls it);
    ``sample_at`` takes the raw context handle (the batched engine's)."""

    def __init__(self, chain, *, n_vocab: int, k: int | None,
                 bias: dict[int, float]) -> None:
        self.chain = chain
        self.k = k
        self._n_vocab = n_vocab
        self._next_threshold: float | None = None
        #: Steps sampled from a shortlist.
        self.shortlisted = 0
        if k is not None:
            self._above = np.empty(n_vocab, dtype=bool)
            order = sorted(bias)
            self._bias_ids = np.array(order, dtype=np.intp)
            self._bias = np.array([bias[t] for t in order], dtype=np.float32)
            self._cur = llama_cpp.llama_token_data_array()
            self._cur_ref = ctypes.byref(self._cur)
            self._data = np.empty(0, dtype=_TOKEN_DATA)
            self._reserve(max(k + 1, 256))

    # What llama-cpp-python and the engines use of the chain.

    @property
    def sampler(self):
        """The ``llama_sampler *`` of the chain."""
        return self.chain.sampler

    def sample(self, ctx, idx: int = -1) -> int:
        """``LlamaSampler.sample``: ``ctx`` is llama-cpp-python's context
        wrapper."""
        return self.sample_at(ctx.ctx, idx)

    def close(self) -> None:
        self.chain.close()

    # Sampling.

    def sample_at(self, ctx, idx: int) -> int:
        """The next token from the logits at output ``idx`` of ``ctx`` (a
        ``llama_context *``); the chain accepts it."""
        if self.k is not None:
            pointer = llama_cpp.llama_get_logits_ith(ctx, idx)
            if pointer:
                token = self.sample_logits(
                    np.ctypeslib.as_array(pointer, shape=(self._n_vocab,)))
                if token is not None:
                    return token
        return llama_cpp.llama_sampler_sample(self.chain.sampler, ctx, idx)

    def sample_logits(self, logits: np.ndarray) -> int | None:
        """The chain's token for ``logits`` (one per vocabulary entry, read
        only) from a shortlist, accepted; None where no shortlist is sure
        to give the full path's token (nothing sampled, nothing accepted)."""
        found = self._find(logits)
        if found is None:
            return None
        ids, raw, ranked = found
        if self.k > 1:
            # top-k's partial sort orders equal values by their place in the
            # array, which the shortlist changes: only distinct ones are sure.
            top = ranked[-(self.k + 1):]
            if not (top[1:] > top[:-1]).all():
                return None
        # The k-th best logit moves less from one token to the next than
        # the best does: the next step tries a threshold just below this
        # one's first, which saves the pass over the vocabulary for the best.
        self._next_threshold = float(ranked[-self.k]) - NEXT_SLACK
        return self._apply(ids, raw)

    def _find(self, logits: np.ndarray):
        """A shortlist of ``logits`` with at least k tokens at or above its
        threshold after the bias: its ids (in id order), their raw logits
        and their biased values sorted; None if none was found."""
        if self._next_threshold is not None:
            found = self._try(logits, self._next_threshold, MAX_GUESSED)
            if found is not None:
                return found
        best = float(logits.max())
        if not math.isfinite(best):
            return None
        margin = FIRST_MARGIN
        for _ in range(MAX_WIDENINGS + 1):
            found = self._try(logits, best - margin, len(logits))
            if found is not None:
                return found
            margin *= 2
        self._next_threshold = None
        return None

    def _try(self, logits: np.ndarray, threshold: float, longest: int):
        """The shortlist at ``threshold``, or None if it has fewer than k
        tokens at or above it, or more than ``longest`` in all."""
        threshold = np.float32(threshold)
        ids, raw, biased = self._shortlist(logits, threshold)
        if len(ids) > longest:
            return None
        ranked = np.sort(biased)
        if len(ranked) - np.searchsorted(ranked, threshold) < self.k:
            return None
        return ids, raw, ranked

    def _shortlist(self, logits: np.ndarray, threshold):
        """The ids at or above ``threshold`` plus every biased id, in id
        order; their raw logits; and those logits after the bias."""
        np.greater_equal(logits, threshold, out=self._above)
        if len(self._bias_ids):
            self._above[self._bias_ids] = True
        ids = np.flatnonzero(self._above)
        raw = logits[ids]
        if not len(self._bias_ids):
            return ids, raw, raw
        biased = raw.copy()
        biased[np.searchsorted(ids, self._bias_ids)] += self._bias
        return ids, raw, biased

    def _apply(self, ids: np.ndarray, raw: np.ndarray) -> int:
        """Run the chain on the shortlist ``ids`` (logits ``raw``) and
        accept its token."""
        n = len(ids)
        if n > len(self._data):
            self._reserve(n)
        self._data_ids[:n] = ids
        self._data_logits[:n] = raw
        self._data_p[:n] = 0.0
        cur = self._cur
        # A sampler may point the array at a buffer of its own.
        cur.data = self._data_pointer
        cur.size = n
        cur.selected = -1
        cur.sorted = False
        llama_cpp.llama_sampler_apply(self.chain.sampler, self._cur_ref)
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError(f"sampler chain selected {cur.selected} of "
                               f"{cur.size} candidates")
        token = cur.data[cur.selected].id
        llama_cpp.llama_sampler_accept(self.chain.sampler, token)
        self.shortlisted += 1
        return token

    def _reserve(self, n: int) -> None:
        """Room for ``n`` candidates in the array the chain reads."""
        self._data = np.empty(max(n, 2 * len(self._data)), dtype=_TOKEN_DATA)
        self._data_ids = self._data["id"]
        self._data_logits = self._data["logit"]
        self._data_p = self._data["p"]
        self._data_pointer = self._data.ctypes.data_as(
            ctypes.POINTER(llama_cpp.llama_token_data))
