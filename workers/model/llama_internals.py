"""Every use of llama-cpp-python's private parts, in one place.

llama-cpp-python's public ``Llama`` does not expose what the worker needs
for its own token loop and KV-cache management: the raw ``llama_context``
and ``llama_model`` handles that ``llama_cpp.llama_cpp``'s C functions take,
the vocabulary handle, and its ``_internals`` wrappers for a second context
and a batch. They are private and change between releases, so they are
reached only through this module, and so is the engine's ``Llama``
subclass (``EngineLlama``), which depends on the order ``Llama.__init__``
builds and reads its model parameters in. Upgrading the pinned version
(0.3.36, ``pyproject.toml``) means checking this file (``EngineLlama``
wraps ``_init_sampler``'s chains and reads its defaults), plus the one
other override of ``Llama``'s own methods: ``native_bias.LogitBiasLlama``
(``_init_sampler``), which ``EngineLlama`` builds on.
"""

from __future__ import annotations

import inspect

import llama_cpp
from llama_cpp import _internals

from workers.model.native_bias import LogitBiasLlama
from workers.model.shortlist_sampling import ShortlistSampler, shortlist_k
from workers.model.weight_repack import repack_enabled

#: What ``Llama._init_sampler`` takes, with its defaults.
_INIT_SAMPLER = inspect.signature(llama_cpp.Llama._init_sampler)

#: The wrappers of a model, a context and a batch (for type hints).
LlamaModel = _internals.LlamaModel
LlamaContext = _internals.LlamaContext
LlamaBatch = _internals.LlamaBatch


class EngineLlama(LogitBiasLlama):
    """The engine's ``Llama``: also takes ``use_extra_bufts`` (weight
    repacking, ``workers.model.weight_repack``), which llama-cpp-python's
    constructor has no argument for. It builds ``model_params`` and loads
    the model in one call, so the field is set as the params are assigned,
    before the load reads them. Left out, it is what ``--repack auto``
    chooses for this CPU (off on AMX, whose repacked Q4 kernel crashes).

    Its sampler chains sample from a shortlist of the logits where that
    picks the same token (``shortlist_sampling``)."""

    def __init__(self, *args, use_extra_bufts: bool | None = None,
                 **kwargs) -> None:
        if use_extra_bufts is None:
            use_extra_bufts = repack_enabled("auto").enabled
        self._use_extra_bufts = use_extra_bufts
        super().__init__(*args, **kwargs)

    def _init_sampler(self, *args, **sampling):
        """The chain ``Llama`` makes, sampling from a shortlist of the
        logits where its settings allow (``shortlist_sampling``)."""
        chain = super()._init_sampler(*args, **sampling)
        given = _INIT_SAMPLER.bind(self, *args, **sampling)
        given.apply_defaults()  # llama-cpp-python's own defaults
        k = shortlist_k(given.arguments, n_biased=len(self.logit_bias))
        return ShortlistSampler(chain, n_vocab=self.n_vocab(), k=k,
                                bias=self.logit_bias)

    @property
    def model_params(self):
        return self._model_params

    @model_params.setter
    def model_params(self, params) -> None:
        params.use_extra_bufts = self._use_extra_bufts
        self._model_params = params


class BatchLlama(EngineLlama):
    """An ``EngineLlama`` whose context holds ``n_seq_max`` sequences (a
    batched worker's slots) in one unified KV cache.

    Unified, because llama.cpp splits a batch of a per-sequence cache into
    ubatches of consecutive, increasing sequence ids (``split_equal``): a
    step of slots [1, 0], or of slots 0 and 2 with slot 1 idle, would decode
    as one-token ubatches, reading the weights once per slot and missing the
    matrix-matrix kernels (tinyBLAS wants two or more rows): one slot's
    speed for as long as the jobs stay in that order. A unified cache is
    split in batch order (``split_simple``): one ubatch per step, whichever
    slots take part. What it costs: each token's attention spans every live
    sequence's cells (masked), not only its own.

    ``Llama.__init__`` has no argument for either field: they are set as
    the context params are assigned, before any field of them is read, and
    nothing after (but an embedding model's setup) writes them."""

    def __init__(self, *args, n_seq_max: int, **kwargs) -> None:
        self._n_seq_max = n_seq_max
        super().__init__(*args, **kwargs)

    @property
    def context_params(self):
        return self._context_params

    @context_params.setter
    def context_params(self, params) -> None:
        params.n_seq_max = self._n_seq_max
        params.kv_unified = True
        self._context_params = params


def sampler_chain(llama: llama_cpp.Llama, **sampling) -> _internals.LlamaSampler:
    """A sampler chain as ``Llama.generate`` makes it for ``sampling``
    (its seed and ``logit_bias`` as set on ``llama``), owned by the caller
    (``close`` frees it)."""
    return llama._init_sampler(**sampling)


def context_handle(llama: llama_cpp.Llama):
    """The ``llama_context *`` the C functions take."""
    return llama._ctx.ctx


def model_handle(llama: llama_cpp.Llama):
    """The ``llama_model *`` the C functions take."""
    return llama._model.model


def vocab_handle(llama: llama_cpp.Llama):
    """The ``llama_vocab *`` of the model."""
    return llama._model.vocab


def model_wrapper(llama: llama_cpp.Llama) -> LlamaModel:
    """llama-cpp-python's wrapper of the model (token texts, BOS/EOS)."""
    return llama._model


def memory(llama: llama_cpp.Llama):
    """The context's KV memory (``llama_memory_t``), or None."""
    return llama_cpp.llama_get_memory(llama._ctx.ctx)


def new_context(llama: llama_cpp.Llama, params) -> LlamaContext:
    """A second context on the same loaded model (weights shared)."""
    return _internals.LlamaContext(model=llama._model, params=params, verbose=False)


def new_batch(n_tokens: int) -> LlamaBatch:
    """A token batch of ``n_tokens`` for one sequence."""
    return _internals.LlamaBatch(n_tokens=n_tokens, embd=0, n_seq_max=1,
                                 verbose=False)


def decode_alone(ctx: LlamaContext, batch: LlamaBatch, tokens: list[int]) -> None:
    """Decode ``tokens`` in ``ctx`` as sequence 0 from position 0, alone:
    the context's KV cache is emptied first (every position's output
    requested, for pooling)."""
    ctx.kv_cache_clear()
    batch.reset()
    batch.add_sequence(tokens, 0, True)
    ctx.decode(batch)


def pooled_embedding(ctx: LlamaContext, seq_id: int = 0):
    """The pooled embedding of sequence ``seq_id`` after a decode (a
    ``float *`` of ``n_embd`` values, NULL if there is none)."""
    return llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq_id)


def set_evaluated(llama: llama_cpp.Llama, n_tokens: int) -> None:
    """Make ``Llama``'s own record say the first ``n_tokens`` of its
    ``input_ids`` are what the KV cache holds (after the cache was trimmed
    or loaded behind its back), and that the next ``generate`` must
    evaluate before it samples."""
    llama.n_tokens = n_tokens
    # Only read by generate(reset=True); keeps the object consistent anyway.
    llama._requires_eval = True
