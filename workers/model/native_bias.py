"""llama.cpp's own logit-bias sampler in llama-cpp-python's sampler chain.

llama-cpp-python takes logit changes only as a ``LogitsProcessorList``: a
Python callback that its chain calls for every token, on a NumPy view of the
whole vocabulary, which it then copies back. For a bias or a ban of a few
tokens (``logit_bias``, ``ignore_eos``) that costs more than the change
itself: on Gemma 3 (262k tokens), about 1.2 ms more to the first token
(BENCHMARKS.md section 18; per later token the difference is below what
this machine can measure). llama-server applies both with llama.cpp's
logit-bias sampler, in C.

``LogitBiasLlama`` does the same: while its ``logit_bias`` is set, each
sampler chain it makes gets llama.cpp's logit-bias sampler right after the
Python processors (which see the raw logits first, as before: log-
probabilities are read there) and ahead of the rest (penalties, top-k, ...),
where llama-server puts it.
"""

from __future__ import annotations

import llama_cpp


class LogitBiasLlama(llama_cpp.Llama):
    """``llama_cpp.Llama`` whose sampler chains apply ``logit_bias`` in C."""

    #: Token id -> bias (``-inf``: never) for the chains made while it is
    #: set, i.e. by the ``generate`` started meanwhile. Empty: none.
    logit_bias: dict[int, float] = {}

    def _init_sampler(self, *args, **kwargs):
        chain = super()._init_sampler(*args, **kwargs)
        if not self.logit_bias:
            return chain
        # llama-cpp-python adds its Python processors first (one custom
        # sampler, at index 0) and the rest after: the rest is taken out,
        # the bias added, and the rest put back in its order. A sampler
        # taken out of a chain is owned by the caller until it is added again.
        first = len(chain.custom_samplers)
        rest = [llama_cpp.llama_sampler_chain_remove(chain.sampler, first)
                for _ in range(llama_cpp.llama_sampler_chain_n(chain.sampler) - first)]
        chain.add_logit_bias(self.n_vocab(), self.logit_bias)
        for sampler in rest:
            llama_cpp.llama_sampler_chain_add(chain.sampler, sampler)
        return chain
