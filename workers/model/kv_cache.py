"""Prompt-prefix reuse for one KV sequence (``workers.model.kv_sequence``).

``Llama.generate(reset=True)`` already matches the new prompt against the
tokens it evaluated last time, but it trusts its own bookkeeping
(``n_tokens`` / ``input_ids``) blindly and asks llama.cpp for no proof that
the cache really holds those positions. Here the reusable prefix is the
overlap of three things: the new prompt, the ids Python remembers, and the
positions the memory module reports (``llama_memory_seq_pos_min/max``). The
cache is then trimmed with ``llama_memory_seq_rm``, whose result is checked;
only when a memory type cannot drop a tail (recurrent / hybrid models) or an
SWA cache has already evicted what the suffix would attend to do we clear
everything. The caller then runs ``generate(plan.tokens, reset=plan.reset)``.

A one-slot engine's sequence is ``Llama``'s (id 0, its record
``input_ids``/``n_tokens``); a batched engine's slot has its own sequence id
and record in the shared context. The rules are the same for both.

Tokens say nothing of whose prompt they were: the tenant check comes first,
in ``prompt_reuse.PromptReuse.prepare``, which passes ``reuse=False`` here
for a prompt of another tenant than the live sequence's (issue 29), so that
sequence is cleared, never extended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import llama_cpp

from workers.model import llama_internals
from workers.model.kv_sequence import LlamaSequence, SlotSequence

KvSequence = LlamaSequence | SlotSequence


@dataclasses.dataclass(frozen=True)
class ReusePlan:
    """What to hand to ``Llama.generate`` after the cache has been trimmed.

    Attributes:
        tokens: Prompt suffix still to evaluate; never empty, so the first
            sample always comes from a fresh decode.
        reset: Value for ``generate(reset=...)``. Always False: the cache is
            already in the right state and generate's own prefix logic must
            not run again.
        cached_tokens: Prompt tokens served from the KV cache.
    """

    tokens: list[int]
    reset: bool
    cached_tokens: int


def reusable_prefix(sequence: KvSequence, prompt: Sequence[int]) -> int:
    """Count the leading prompt tokens the KV cache can serve, without changes.

    Always leaves at least one prompt token to evaluate. Useful for routing a
    request to the worker whose cache holds the longest prefix.

    Args:
        sequence: The sequence whose cache to inspect.
        prompt: Full prompt token ids.

    Returns:
        Number of prompt tokens that need no evaluation (0 if none).
    """
    llama = sequence.llama
    mem = llama_internals.memory(llama)
    if mem is None or len(prompt) < 2:
        return 0
    pos_min = llama_cpp.llama_memory_seq_pos_min(mem, sequence.seq)
    pos_max = llama_cpp.llama_memory_seq_pos_max(mem, sequence.seq)
    # Python's record can outrun the cache (an eval that raised after
    # llama_decode, input_ids shorter than the padded context, ...): only
    # positions present in both count.
    ids = sequence.ids
    known = min(sequence.n_known, pos_max + 1, len(ids))
    # The last prompt token is re-evaluated so sampling sees live logits.
    limit = min(known, len(prompt) - 1)
    if limit <= 0:
        return 0
    cached = ids[:limit]
    mismatch = (cached != prompt[:limit]).nonzero()[0]
    keep = int(mismatch[0]) if len(mismatch) else limit
    if keep > 0 and pos_min > 0:
        # SWA cache without swa_full: positions below pos_min were evicted.
        # The suffix starting at `keep` attends back n_swa positions, which
        # must all still be there (same rule as llama.cpp's server).
        n_swa = llama_cpp.llama_model_n_swa(llama_internals.model_handle(llama))
        if pos_min > max(0, keep - n_swa):
            return 0
    return keep


def plan_reuse(sequence: KvSequence, prompt: Sequence[int],
               reuse: bool = True) -> ReusePlan:
    """Trim the sequence to the longest reusable prefix of ``prompt``.

    Call right before ``generate``; afterwards run
    ``llama.generate(plan.tokens, reset=plan.reset, ...)``. Safe after a
    generation that was stopped early, streamed, or ended with an error.

    Args:
        sequence: The sequence to prepare.
        prompt: Full prompt token ids (non-empty).
        reuse: False (a request's ``cache_prompt: false``): clear the cache
            and evaluate the whole prompt.

    Returns:
        The plan: suffix tokens to evaluate and how many were reused.

    Raises:
        ValueError: If ``prompt`` is empty.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt")
    mem = llama_internals.memory(sequence.llama)
    keep = reusable_prefix(sequence, prompt) if reuse else 0
    # seq_rm returns False when the memory cannot drop a tail (recurrent
    # state); then nothing is reusable.
    if keep > 0 and not llama_cpp.llama_memory_seq_rm(mem, sequence.seq, keep, -1):
        keep = 0
    if keep == 0:
        sequence.clear()
    sequence.set_known(keep)
    return ReusePlan(tokens=prompt[keep:], reset=False, cached_tokens=keep)
