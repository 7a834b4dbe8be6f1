"""What the batched worker's unified KV cache costs a decode step.

A ``BatchedEngine`` of K slots prefills an N-token prompt into each
sequence, then decodes one token per sequence per step with its own
``decode``; the median step is printed. ``--cache per-sequence`` gives the
context a KV cache per sequence instead (llama.cpp's default). The steps
list the slots 0, 1, ..., K-1, the one order in which such a cache also
decodes a step as one ubatch, so the two differ only in what attention
spans: every live sequence's cells (masked) against the sequence's own.

    python -m tests.bench.unified_cache_cost --cache unified|per-sequence \\
        [--prompt-tokens 1800] [--slots 4] [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tests.bench import harness
from workers.model import llama_internals
from workers.model.batched_engine import BatchedEngine
from workers.model.weight_repack import repack_enabled

STEPS = 40
WARM_STEPS = 5


_UnifiedCacheLlama = llama_internals.BatchLlama


class _PerSequenceCacheLlama(_UnifiedCacheLlama):
    """``BatchLlama`` with llama.cpp's default cache, one per sequence."""

    def _set_params(self, params) -> None:
        _UnifiedCacheLlama.context_params.fset(self, params)
        params.kv_unified = False

    context_params = property(_UnifiedCacheLlama.context_params.fget, _set_params)


class _Slot:
    """A sequence as ``BatchedEngine.decode`` reads it."""

    def __init__(self, sequence) -> None:
        self.sequence = sequence


def step_ms(engine: BatchedEngine, n_prompt: int) -> float:
    """Median ms of a step of one token per slot, after N-token prompts."""
    rng = random.Random(0)
    slots = [_Slot(reuse.sequence) for reuse in engine.reuse]
    for slot in slots:
        prompt = [rng.randrange(1000, 20000) for _ in range(n_prompt)]
        for start in range(0, n_prompt, engine.n_batch):
            engine.decode([(slot, prompt[start:start + engine.n_batch], False)])
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        engine.decode([(slot, [1234], True) for slot in slots])
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[WARM_STEPS:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--cache", choices=("unified", "per-sequence"),
                        default="unified")
    parser.add_argument("--prompt-tokens", type=int, default=1800)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flash-attn", choices=("on", "off"),
                        default="on" if harness.POOL_FLASH_ATTN else "off")
    args = parser.parse_args(argv)
    if args.cache == "per-sequence":
        # BatchedEngine builds its context through this name.
        llama_internals.BatchLlama = _PerSequenceCacheLlama
    engine = BatchedEngine(args.model or harness.default_model(),
                           n_slots=args.slots, n_threads=args.threads,
                           flash_attn=args.flash_attn == "on",
                           repack=repack_enabled("auto"))
    print(f"{args.cache} cache, {args.slots} slots x {args.prompt_tokens} prompt "
          f"tokens, flash attention {args.flash_attn}: "
          f"{step_ms(engine, args.prompt_tokens):.1f} ms per step (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
