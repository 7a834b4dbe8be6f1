"""One KV sequence and the record of the tokens it holds.

llama.cpp's memory module says which positions a sequence holds
(``llama_memory_seq_pos_min/max``), not which tokens: that record is kept
on the Python side. A one-slot engine's record is ``Llama``'s own
(``input_ids`` and ``n_tokens``, which its ``generate`` reads and writes),
for the only sequence it uses, 0. A batched engine's slot keeps its own
record for its sequence of the shared context. ``kv_cache`` and
``prompt_reuse`` read, trim, save and restore a sequence only through
these two classes, so both engines reuse prompts by the same rules.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from workers.model import llama_internals


class LlamaSequence:
    """Sequence 0 of a one-slot ``Llama``, its record ``Llama``'s own."""

    seq = 0

    def __init__(self, llama: llama_cpp.Llama) -> None:
        self.llama = llama

    @property
    def ids(self) -> np.ndarray:
        """The record (its length is the most the sequence can hold)."""
        return self.llama.input_ids

    @property
    def n_known(self) -> int:
        """Leading entries of ``ids`` the sequence holds, as Python knows."""
        return self.llama.n_tokens

    def set_known(self, n: int) -> None:
        """The sequence holds the first ``n`` recorded tokens now (it was
        trimmed); ``generate`` must evaluate before it samples."""
        llama_internals.set_evaluated(self.llama, n)

    def load(self, tokens: np.ndarray) -> None:
        """A restored state holds exactly ``tokens``."""
        n = len(tokens)
        self.llama.input_ids[:n] = tokens
        self.llama.n_tokens = n

    def clear(self) -> None:
        """Empty the sequence (the whole KV cache: it is the only one)."""
        mem = llama_internals.memory(self.llama)
        if mem is not None:
            llama_cpp.llama_memory_clear(mem, True)
        self.llama.n_tokens = 0


class SlotSequence:
    """Sequence ``seq`` of a batched context, with a record of its own of
    ``capacity`` tokens (the slot's share of the context)."""

    def __init__(self, llama: llama_cpp.Llama, seq: int, capacity: int) -> None:
        self.llama = llama
        self.seq = seq
        self.ids = np.zeros(capacity, dtype=np.intc)
        self.n_known = 0

    def set_known(self, n: int) -> None:
        self.n_known = n

    def load(self, tokens: np.ndarray) -> None:
        n = len(tokens)
        self.ids[:n] = tokens
        self.n_known = n

    def extend(self, tokens: list[int]) -> None:
        """``tokens`` were just decoded at the sequence's next positions."""
        n = self.n_known
        self.ids[n:n + len(tokens)] = tokens
        self.n_known = n + len(tokens)

    def clear(self) -> None:
        """Empty this sequence only (the other slots' stay)."""
        mem = llama_internals.memory(self.llama)
        if mem is not None:
            llama_cpp.llama_memory_seq_rm(mem, self.seq, -1, -1)
        self.n_known = 0
