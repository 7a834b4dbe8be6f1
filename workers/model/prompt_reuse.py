"""Which cached tokens a prompt starts from: the live KV sequence or a saved state.

``prepare`` is the one decision. It compares the prefix the live KV sequence
can serve (``kv_cache.reusable_prefix``) with the longest prefix among the
saved states (``prompt_cache.PromptStateCache``); the longer one wins, even
when that means replacing the sequence already loaded (llama.cpp's server
stops at the loaded one, ggml-org/llama.cpp#28276). Before the live sequence
is cut by more than a block of tokens, it is saved, unless it was saved
already: the worker calls ``save_live`` between jobs when none waits, so a
new conversation mostly finds the one it displaces saved in idle time, not
in its own time to first token. Then ``kv_cache.plan_reuse`` trims the KV
cache exactly as it did before there was a cache.

Reuse is scoped to a tenant (``GenerationRequest.cache_tenant``, issue 29).
The live sequence's tenant is kept here (``live_tenant``) and every saved
state carries its own; a prompt reuses only its own tenant's. Another
tenant's live sequence is saved (as that tenant's) and then cleared, never
extended, and its saved states are not even compared, so ``cached_tokens``,
``timings.cache_n`` and the time to first token are those of a cold prompt:
one key cannot learn whether another sent the same prefix, whatever slot
it asks for (``id_slot``).

States are per sequence (``llama_state_seq_get_data`` / ``set_data`` on
the sequence's id: 0 for a one-slot engine, the slot's for a batched one,
whose slots share one cache): the KV cells only. The whole-context ``Llama.save_state`` also
copies the logits of every batch position (n_batch x n_vocab floats, 512 MB
for Gemma's 262 k vocabulary at n_batch 512), which a restore does not need:
the last prompt token is always evaluated again.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence

import llama_cpp
import numpy as np

from protocol.prefix import prefix_blocks
from workers.model import kv_cache, llama_internals
from workers.model import tracing as worker_tracing
from workers.model.kv_cache import KvSequence
from workers.model.prompt_cache import (
    MIN_STATE_TOKENS,
    CachedState,
    PromptStateCache,
)

log = logging.getLogger("llamapool.worker")

class PromptReuse:
    """One KV sequence (``kv_sequence``) plus the saved prompt states it
    may start from (a batched engine's slots share theirs)."""

    def __init__(self, sequence: KvSequence, cache: PromptStateCache) -> None:
        self.sequence = sequence
        self.llama = sequence.llama
        self.cache = cache
        #: Whose prompt the live KV sequence holds ("": the shared scope, or
        #: nothing loaded).
        self.live_tenant = ""

    # --- the decision ---

    def prepare(self, prompt: Sequence[int], reuse: bool = True,
                tenant: str = "") -> kv_cache.ReusePlan:
        """Load the best starting state for ``prompt`` and trim the KV cache.

        Args:
            prompt: Full prompt token ids (non-empty).
            reuse: False: start from an empty cache whatever is there
                (the live sequence is still saved first). A request flag such
                as llama.cpp's ``cache_prompt: false`` maps to this.
            tenant: Whose prompt it is (``GenerationRequest.cache_tenant``):
                only this tenant's live sequence or saved states are reused,
                and the sequence is this tenant's from here on.

        Returns:
            ``kv_cache.plan_reuse``'s plan: the suffix to evaluate.
        """
        traced = worker_tracing.current  # None unless this job is traced
        started = time.perf_counter() if traced is not None else 0.0
        own_live = reuse and tenant == self.live_tenant
        live = kv_cache.reusable_prefix(self.sequence, prompt) if own_live else 0
        key, stored = (self.cache.longest_prefix(prompt, tenant) if reuse
                       else (None, 0))
        # The last prompt token is always evaluated again.
        stored = min(stored, len(prompt) - 1)
        # A restore costs tens of ms (BENCHMARKS.md section 12): worth it for a
        # block of tokens or more, not for a chat template's first few.
        use_stored = stored - live >= MIN_STATE_TOKENS
        # What of the live sequence survives this job: worth a saved state
        # when it loses at least a block (not the few tokens by which a
        # chat turn's re-rendered reply differs from the generated one).
        surviving = 0 if use_stored or not own_live else live
        live_len = self.live_length()
        if self.cache.enabled and live_len - surviving >= MIN_STATE_TOKENS:
            self._save_live(live_len)  # as the live sequence's own tenant's
        restored = use_stored and self._restore(key, tenant)
        if not restored and not own_live:
            # Not extended: another tenant's tokens (or, with cache_prompt
            # false, anyone's) must not serve a single position of this one.
            self._clear()
        self.live_tenant = tenant
        plan = kv_cache.plan_reuse(self.sequence, prompt, reuse=own_live or restored)
        if restored and plan.cached_tokens > live:
            self.cache.hits += 1
        elif (self.cache.enabled and len(prompt) > MIN_STATE_TOKENS
              and plan.cached_tokens < MIN_STATE_TOKENS):
            self.cache.misses += 1
        if traced is not None:
            traced.note_plan(started, live=live,
                             restored=plan.cached_tokens if restored else 0,
                             cached=plan.cached_tokens, prompt=len(prompt))
        return plan

    def save_live(self) -> bool:
        """Save the live sequence now, if it is worth a state and not held
        yet; True if a state was added. Between jobs, so that the next job
        that moves away from this sequence does not copy it in its own time
        to first token."""
        n = self.live_length()
        if not self.cache.enabled or n < MIN_STATE_TOKENS:
            return False
        return self._save_live(n)

    # --- llama.cpp state ---

    def live_length(self) -> int:
        """Tokens of the live sequence that both Python and the KV cache hold."""
        mem = llama_internals.memory(self.llama)
        if mem is None:
            return 0
        sequence = self.sequence
        pos_max = llama_cpp.llama_memory_seq_pos_max(mem, sequence.seq)
        return max(0, min(sequence.n_known, pos_max + 1, len(sequence.ids)))

    def _save_live(self, n: int) -> bool:
        """Save the first ``n`` tokens' state; True if it was added."""
        # A save copies the whole KV state (6.5 ms for 128 tokens of Gemma):
        # not for a copy of a copy.
        ids, seq = self.sequence.ids, self.sequence.seq
        if self.cache.holds(ids[:n], self.live_tenant):
            return False
        mem = llama_internals.memory(self.llama)
        # An SWA cache that already evicted the start of the sequence
        # (swa_full off) could only serve prompts ending near its end.
        if llama_cpp.llama_memory_seq_pos_min(mem, seq) > 0:
            return False
        data = self._state_bytes(self.cache.limit_bytes - 4 * n)
        if data is None:
            self.cache.dropped += 1
            return False
        return self.cache.put(ids[:n], data, self.live_tenant)

    def _state_bytes(self, max_bytes: int) -> bytes | None:
        """The live sequence's state (its KV cells), or None if it is larger
        than ``max_bytes`` or llama.cpp fails to copy it."""
        ctx = llama_internals.context_handle(self.llama)
        seq = self.sequence.seq
        size = llama_cpp.llama_state_seq_get_size(ctx, seq)
        if size <= 0 or size > max_bytes:
            return None
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq)
        if written <= 0 or written > size:
            log.warning("saving a prompt state failed (%d of %d bytes)",
                        written, size)
            return None
        return ctypes.string_at(buf, written)

    def live_state(self, tenant: str) -> CachedState:
        """The live sequence as a state (for a slot file,
        ``workers.model.slot_files``): ``tenant``'s tokens, or none when the
        sequence holds another tenant's prompt (a save must not copy it).

        Raises:
            RuntimeError: llama.cpp could not copy the state.
        """
        n = self.live_length() if tenant == self.live_tenant else 0
        data = b""
        if n > 0:
            data = self._state_bytes(1 << 62)
            if data is None:
                raise RuntimeError("llama.cpp could not copy the slot's state")
        return self.cache.state_of(self.sequence.ids[:n], data, tenant)

    def load_state(self, state: CachedState) -> str:
        """Make ``state`` (of a slot file) the live sequence, as its tenant's;
        "" when done, else why not. A state of another model or a damaged one
        is refused before anything is loaded."""
        if state.model_id != self.cache.model_id:
            why = "the file was saved from another model"
        elif not state.intact():
            why = "the file is damaged (state checksum)"
        elif not self._load(state, state.tenant):
            why = "the state does not fit this slot"
        else:
            self.live_tenant = state.tenant
            return ""
        # Refused before loading: the slot keeps what it held (a load that
        # failed midway left it empty, as llama-server's does).
        return why

    def _restore(self, key: int, tenant: str) -> bool:
        """Load ``tenant``'s saved state as the live sequence; False (and an
        empty KV cache) if it cannot be used, which then is dropped."""
        state = self.cache.take(key)
        if state is None:
            return False
        if not self._load(state, tenant):
            log.warning("a cached prompt state could not be restored (%d tokens, "
                        "%d bytes); dropped it", len(state.tokens), len(state.data))
            self.cache.dropped += 1
            return False
        return True

    def _load(self, state: CachedState, tenant: str) -> bool:
        """Load ``state`` as the live sequence if it is this model's, of
        ``tenant``, fits and is intact (its checksum); False (and an empty
        KV cache) if not."""
        n = len(state.tokens)
        ok = (state.model_id == self.cache.model_id and state.tenant == tenant
              and n <= len(self.sequence.ids) and state.intact())
        if ok:
            self._clear()
            data = state.data
            if data:  # an empty slot's state: nothing to load
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                read = llama_cpp.llama_state_seq_set_data(
                    llama_internals.context_handle(self.llama), buf, len(data),
                    self.sequence.seq)
                ok = read == len(data)
            if ok and worker_tracing.current is not None:
                worker_tracing.current.restored_bytes = len(data)
        if not ok:
            self._clear()
            return False
        self.sequence.load(state.tokens)
        return True

    def clear_live(self) -> None:
        """Empty the live sequence without saving it (after a warm-up)."""
        self._clear()
        self.live_tenant = ""

    def _clear(self) -> None:
        self.sequence.clear()

    # --- what the broker is told ---

    def reported_blocks(self) -> list[list[int]]:
        """Fingerprints of the live sequence, then of the saved states."""
        live = self.live_length()
        live_blocks = prefix_blocks(np.asarray(self.sequence.ids[:live]).tolist(),
                                    self.live_tenant)
        return [live_blocks, *self.cache.reported_blocks()]
