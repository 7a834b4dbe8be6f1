"""The batched worker's ceiling: its engine's own context decoding K
sequences in a bare loop, in a child process, with no runner, link or hop.

Each step is one ``llama_decode`` of one token per sequence and one
``llama_sampler_sample`` per sequence with the chain a request of default
sampling gets, as the worker's decode loop does; prompt prefill is not
timed. What a batched pool loses against this is the pool's: its decode
loop, its frames and hops, and the steps a slot sits out between jobs.

    python -m tests.bench.batched_ceiling [--slots 2] [--flash-attn]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time


def _loop(model: str, n_slots: int, n_threads: int, prompt: str, n_tokens: int,
          reps: int, flash_attn: bool, results) -> None:
    import llama_cpp

    from workers.model import llama_internals
    from workers.model.batched_engine import BatchedEngine
    from workers.model.weight_repack import repack_enabled

    engine = BatchedEngine(model, n_slots=n_slots, n_threads=n_threads,
                           flash_attn=flash_attn, repack=repack_enabled("auto"))
    ctx, batch = engine._ctx, engine._batch.batch
    memory = llama_cpp.llama_get_memory(ctx)
    tokens = engine.llama.tokenize(prompt.encode())
    samplers = [llama_internals.sampler_chain(
        engine.llama, temp=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0,
        repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        for _ in range(n_slots)]

    def fill(entries: list[tuple[int, list[int], int]]) -> None:
        n = 0
        for seq, ids, pos in entries:
            for i, token in enumerate(ids):
                batch.token[n], batch.pos[n] = token, pos + i
                batch.n_seq_id[n], batch.seq_id[n][0] = 1, seq
                batch.logits[n] = False
                n += 1
            batch.logits[n - 1] = True
        batch.n_tokens = n

    decode_s = sample_s = 0.0
    for rep in range(reps + 1):  # the first is a warm-up
        for seq in range(n_slots):
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        fill([(seq, tokens, 0) for seq in range(n_slots)])
        llama_cpp.llama_decode(ctx, batch)
        last, pos = [tokens[-1]] * n_slots, len(tokens)
        for _ in range(n_tokens):
            fill([(seq, [last[seq]], pos) for seq in range(n_slots)])
            started = time.perf_counter()
            llama_cpp.llama_decode(ctx, batch)
            decoded = time.perf_counter()
            last = [llama_cpp.llama_sampler_sample(samplers[seq].sampler, ctx, seq)
                    for seq in range(n_slots)]
            if rep:
                decode_s += decoded - started
                sample_s += time.perf_counter() - decoded
            pos += 1
    steps = reps * n_tokens
    results.put({"output_tokens_per_s": steps * n_slots / (decode_s + sample_s),
                 "decode_ms_per_step": 1000 * decode_s / steps,
                 "sample_ms_per_step": 1000 * sample_s / steps})


def batched_generate(model: str, n_slots: int, n_threads: int, prompt: str,
                     n_tokens: int, reps: int, *, flash_attn: bool = False) -> dict:
    """Tokens/s of the bare loop, and its decode and sampling ms per step."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_loop, args=(model, n_slots, n_threads, prompt,
                                            n_tokens, reps, flash_attn, results))
    child.start()
    outcome = results.get(timeout=3600)
    child.join()
    return outcome


def main(argv: list[str] | None = None) -> int:
    import os

    from tests.bench import harness
    from tests.bench.bench_throughput import PROMPT

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--flash-attn", action="store_true")
    args = parser.parse_args(argv)
    print(batched_generate(args.model or harness.default_model(), args.slots,
                           args.threads, PROMPT, args.tokens, args.reps,
                           flash_attn=args.flash_attn))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
