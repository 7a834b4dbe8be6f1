"""The batched worker's ceiling: its engine's own context decoding K
sequences in a bare loop, in a child process, with no runner, link or hop.

Each step samples every sequence with the sampler chain a request of
default sampling gets and decodes one token per sequence, with the
engine's own ``start``, ``sample`` and ``decode``, as the worker's decode
loop calls them; prompt prefill is not timed. What a batched pool loses
against this is the pool's: the rest of its decode loop (each token's
text, stop strings and frame), its hops, and the steps a slot sits out
between jobs.

    python -m tests.bench.batched_ceiling [--slots 2] [--flash-attn on|off]
"""

from __future__ import annotations

import time

from tests.bench import harness
from tests.bench.harness import POOL_FLASH_ATTN


def _loop(model: str, n_slots: int, n_threads: int, prompt: str, n_tokens: int,
          reps: int, flash_attn: bool, results) -> None:
    from protocol import messages
    from protocol.payloads import COMPLETION, GenerationRequest
    from workers.model.active_job import ActiveJob
    from workers.model.batched_engine import BatchedEngine
    from workers.model.settings import WorkerSettings
    from workers.model.weight_repack import repack_enabled

    engine = BatchedEngine(model, n_slots=n_slots, n_threads=n_threads,
                           flash_attn=flash_attn, repack=repack_enabled("auto"))
    settings = WorkerSettings(broker_endpoint="ipc:///nobody", n_slots=n_slots)
    # Default sampling; the whole prompt prefilled each time (no reuse).
    request = GenerationRequest(kind=COMPLETION, prompt=prompt, cache_prompt=False)
    decode_s = sample_s = 0.0
    for rep in range(reps + 1):  # the first is a warm-up
        slots = [engine.start(seq, ActiveJob(messages.Submit(f"{rep}-{seq}", request),
                                             lambda _frame: None, settings))
                 for seq in range(n_slots)]
        indices = engine.decode([(slot, *slot.prompt_chunk(engine.n_batch))
                                 for slot in slots])
        for _ in range(n_tokens):
            started = time.perf_counter()
            last = [engine.sample(slot, index) for slot, index in zip(slots, indices)]
            sampled = time.perf_counter()
            indices = engine.decode([(slot, [token], True)
                                     for slot, token in zip(slots, last)])
            if rep:
                sample_s += sampled - started
                decode_s += time.perf_counter() - sampled
        for slot in slots:
            slot.close()
    steps = reps * n_tokens
    results.put({"output_tokens_per_s": steps * n_slots / (decode_s + sample_s),
                 "decode_ms_per_step": 1000 * decode_s / steps,
                 "sample_ms_per_step": 1000 * sample_s / steps})


def batched_generate(model: str, n_slots: int, n_threads: int, prompt: str,
                     n_tokens: int, reps: int, *,
                     flash_attn: bool = POOL_FLASH_ATTN) -> dict:
    """Tokens/s of the bare loop, and its decode and sampling ms per step."""
    return harness.in_child(_loop, model, n_slots, n_threads, prompt, n_tokens,
                            reps, flash_attn)


def main(argv: list[str] | None = None) -> int:
    from tests.bench.bench_throughput import PROMPT

    parser = harness.batched_engine_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args(argv)
    print(batched_generate(args.model or harness.default_model(), args.slots,
                           args.threads, PROMPT, args.tokens, args.reps,
                           flash_attn=args.flash_attn == "on"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
