"""A worker's prompt-state cache: many conversations' KV states in RAM.

A worker has one KV cache holding one sequence. Chat clients resend the whole
history every turn, so with more conversations than workers each turn used
to find its worker busy forgetting someone else's conversation. Before a job
overwrites the live sequence, the engine saves it here (its sequence state,
``llama_state_seq_get_data``: the KV cells of sequence 0 only, no logits),
together with its exact token ids; a later prompt restores the state that
shares the longest prefix with it, if that beats what is already loaded.

Bounded by bytes (``--cache-ram``), least recently used out first. The cache
lives in the process's memory, so a restarted worker starts empty, and every
state carries the identity of the model that made it: a state is never
restored into another model. It also carries its tenant
(``GenerationRequest.cache_tenant``): only a prompt of the same tenant finds
it, supersedes it or is told it is held, so no API key learns from
``cached_tokens`` or timing whether another key sent a prompt (issue 29).
This module does the bookkeeping only; the llama.cpp calls are in
``workers.model.prompt_reuse``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import zlib
from collections.abc import Sequence

import numpy as np

from protocol import limits
from protocol.prefix import BLOCK_TOKENS, prefix_blocks
from protocol.prompt_cache import PromptCacheStatus

MIB = 1024 * 1024

#: A sequence shorter than this is not worth a state: it holds no complete
#: fingerprint block, so the broker could never route to it.
MIN_STATE_TOKENS = BLOCK_TOKENS


@dataclasses.dataclass(frozen=True)
class CachedState:
    """One saved sequence: its tokens, the state bytes, who made it."""

    tokens: np.ndarray
    data: bytes
    model_id: str
    #: ``protocol.prefix`` fingerprints of ``tokens`` in ``tenant``'s scope,
    #: for CACHE_REPORT.
    blocks: tuple[int, ...]
    #: CRC32 of ``data`` when saved. llama.cpp checks a state's layout, not
    #: its contents: damaged KV bytes load without complaint and the model
    #: then continues from a wrong cache (tried: 64 flipped bytes in the
    #: middle of a state were restored as 167 cached tokens).
    crc32: int = 0
    #: Whose prompt this was ("": the pool's shared scope); reused only for
    #: the same tenant.
    tenant: str = ""

    def intact(self) -> bool:
        return zlib.crc32(self.data) == self.crc32

    @property
    def n_bytes(self) -> int:
        # The token ids are kept too (4 bytes each, numpy intc).
        return len(self.data) + self.tokens.nbytes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


class PromptStateCache:
    """LRU of prompt states bounded by ``limit_bytes`` (0: disabled).

    Not thread-safe: the engine (main thread) owns it. What other threads
    read (the report for the broker, the figures for metrics) is published
    as immutable snapshots by ``publish``.
    """

    def __init__(self, limit_bytes: int, model_id: str) -> None:
        self.limit_bytes = max(0, int(limit_bytes))
        self.model_id = model_id
        self._states: collections.OrderedDict[int, CachedState] = (
            collections.OrderedDict())
        self._keys = itertools.count()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    def __len__(self) -> int:
        return len(self._states)

    # --- lookups ---

    def longest_prefix(self, prompt: Sequence[int], tenant: str = ""
                       ) -> tuple[int | None, int]:
        """The state of ``tenant`` sharing the most leading tokens with
        ``prompt``; another tenant's states are not looked at.

        Returns:
            (key, shared tokens), or (None, 0) when nothing shares any.
        """
        if not self._states:
            return None, 0
        arr = np.asarray(prompt, dtype=np.intc)
        best_key, best_n = None, 0
        # Newest first, done at a state that holds the whole prompt: a cache
        # full of one prompt's sampled replies (a benchmark, "regenerate")
        # costs one comparison in the job's time to first token, not one per
        # state.
        for key, state in reversed(self._states.items()):
            if state.tenant != tenant:
                continue
            n = common_prefix(state.tokens, arr)
            if n > best_n:
                best_key, best_n = key, n
                if n == len(arr):
                    break
        return best_key, best_n

    def holds(self, tokens: Sequence[int], tenant: str = "") -> bool:
        """Whether a state of ``tenant`` starts with all of ``tokens``: saving
        them again would only copy it (the same prompt sent again finds its
        last reply in the KV cache). That state counts as just used."""
        arr = np.asarray(tokens, dtype=np.intc)
        for key, state in reversed(self._states.items()):  # mostly the last saved
            if (state.tenant == tenant and len(state.tokens) >= len(arr)
                    and common_prefix(state.tokens, arr) == len(arr)):
                self._states.move_to_end(key)
                return True
        return False

    def take(self, key: int) -> CachedState | None:
        """Remove and return a state to restore it.

        Once restored it is the live sequence; when a later job moves away
        from it, the engine saves it again, grown by that turn. Keeping it
        here meanwhile would only hold the same conversation twice.
        """
        state = self._states.pop(key, None)
        if state is not None:
            self.bytes_used -= state.n_bytes
        return state

    def state_of(self, tokens: Sequence[int], data: bytes,
                 tenant: str = "") -> CachedState:
        """A state of this cache's model, checksummed, not kept (``put``
        keeps one; a slot file, ``workers.model.slot_files``, writes one)."""
        arr = np.asarray(tokens, dtype=np.intc).copy()
        data = bytes(data)
        return CachedState(arr, data, self.model_id,
                           tuple(prefix_blocks(arr.tolist(), tenant)),
                           zlib.crc32(data), tenant)

    # --- changes ---

    def put(self, tokens: Sequence[int], data: bytes, tenant: str = "") -> bool:
        """Keep ``tenant``'s state; evict the least recently used ones to fit
        (of any tenant: the bytes are the worker's).

        A state larger than the whole limit is refused (``dropped``). A
        cached state of the same tenant whose tokens are a prefix of
        ``tokens`` is superseded (the new one serves everything it served)
        and removed.

        Returns:
            Whether the state was kept.
        """
        state = self.state_of(tokens, data, tenant)
        arr = state.tokens
        if not self.enabled or state.n_bytes > self.limit_bytes:
            self.dropped += 1
            return False
        for key in [k for k, s in self._states.items()
                    if s.tenant == tenant and len(s.tokens) <= len(arr)
                    and common_prefix(s.tokens, arr) == len(s.tokens)]:
            self.take(key)
        while self._states and self.bytes_used + state.n_bytes > self.limit_bytes:
            _, old = self._states.popitem(last=False)
            self.bytes_used -= old.n_bytes
            self.evictions += 1
        self._states[next(self._keys)] = state
        self.bytes_used += state.n_bytes
        return True

    # --- what the broker and operators see ---

    def status(self) -> PromptCacheStatus:
        return PromptCacheStatus(
            states=len(self._states), bytes_used=self.bytes_used,
            bytes_limit=self.limit_bytes, hits=self.hits, misses=self.misses,
            evictions=self.evictions, dropped=self.dropped)

    def reported_blocks(self) -> list[list[int]]:
        """Fingerprint lists of the most recently used states (those with at
        least one block), newest first, as many as a CACHE_REPORT carries."""
        out: list[list[int]] = []
        for state in reversed(self._states.values()):
            if len(out) >= limits.MAX_REPORTED_STATES - 1:  # one is the live seq
                break
            if state.blocks:
                out.append(list(state.blocks))
        return out
