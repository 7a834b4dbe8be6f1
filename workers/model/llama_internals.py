"""Every use of llama-cpp-python's private parts, in one place.

llama-cpp-python's public ``Llama`` does not expose what the worker needs
for its own token loop and KV-cache management: the raw ``llama_context``
and ``llama_model`` handles that ``llama_cpp.llama_cpp``'s C functions take,
the vocabulary handle, and its ``_internals`` wrappers for a second context
and a batch. They are private and change between releases, so they are
reached only through this module; upgrading the pinned version (0.3.36,
``pyproject.toml``) means checking this file, plus the two overrides of
``Llama``'s own methods that subclass it: ``native_bias.LogitBiasLlama``
(``_init_sampler``) and ``llama_engine.EngineLlama`` (``model_params``).
"""

from __future__ import annotations

import llama_cpp
from llama_cpp import _internals

#: The wrappers of a model, a context and a batch (for type hints).
LlamaModel = _internals.LlamaModel
LlamaContext = _internals.LlamaContext
LlamaBatch = _internals.LlamaBatch


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
