"""What sampling costs a batched step, and four ways to do it, in one process.

    make bench-sampling   # or: python -m tests.bench.bench_sampling

The batched worker's engine (``BatchedEngine``) decodes K sequences one
token each per step, as the worker's decode loop does, and samples each
with the chain a seeded request of default sampling gets
(``engine.start``). The rounds alternate between four ways to sample:

* ``serial``: each slot's chain in turn on the decoding thread, on the
  whole vocabulary (``llama_sampler_sample``), as llama-server does;
* ``shortlist``: the same, each chain on a shortlist of its logits where
  that gives the same token (``shortlist_sampling``), as the worker does;
* ``threads``: each slot's chain on its own thread at once (the context's
  logits synchronised first), on the cores that decoded;
* ``backend``: each sequence's chain handed to llama.cpp
  (``llama_set_sampler``, llama-server's ``--backend-sampling``), so that
  the leading samplers that can (penalties, top-k) run inside the decode's
  graph, and only what they leave is sampled on the CPU.

Per way: the median ms per step of the decode and of the sampling, output
tokens/s, and whether every token equals ``serial``'s (the same seeds).
With Gemma 3's 262,144-token vocabulary, sampling on the CPU builds a
candidate for every token before top-k cuts it down (but ``shortlist``);
that is what the four ways spend differently.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tests.bench import harness

WAYS = ("serial", "shortlist", "threads", "backend")


def _run(model: str, n_slots: int, n_threads: int, prompt: str, n_tokens: int,
         rounds: int, flash_attn: bool, results) -> None:
    import llama_cpp

    from protocol import messages
    from protocol.payloads import COMPLETION, GenerationRequest, Sampling
    from workers.model.active_job import ActiveJob
    from workers.model import llama_internals
    from workers.model.batched_engine import BatchedEngine
    from workers.model.settings import WorkerSettings
    from workers.model.weight_repack import repack_enabled

    engine = BatchedEngine(model, n_slots=n_slots, n_threads=n_threads,
                           flash_attn=flash_attn, repack=repack_enabled("auto"))
    ctx = llama_internals.context_handle(engine.llama)
    settings = WorkerSettings(broker_endpoint="ipc:///nobody", n_slots=n_slots)
    helpers = ThreadPoolExecutor(max_workers=max(1, n_slots - 1))

    def sample_one(pair) -> int:
        slot, index = pair
        return llama_cpp.llama_sampler_sample(slot.sampler.sampler, ctx, index)

    def sample(way: str, pairs) -> list[int]:
        if way == "shortlist":
            return [engine.sample(slot, index) for slot, index in pairs]
        if way != "threads" or len(pairs) == 1:
            return [sample_one(pair) for pair in pairs]
        # Synchronise and reorder the outputs once, before the chains read
        # them at once (llama_get_logits_ith would, in every thread).
        llama_cpp.llama_get_logits(ctx)
        others = [helpers.submit(sample_one, pair) for pair in pairs[1:]]
        return [sample_one(pairs[0])] + [f.result() for f in others]

    decode_ms = {way: [] for way in WAYS}
    sample_ms = {way: [] for way in WAYS}
    tokens: dict[str, list[list[int]]] = {}
    for rnd in range(rounds + 1):  # round 0 warms up, uncounted
        for way in WAYS:
            requests = [GenerationRequest(
                kind=COMPLETION, prompt=prompt, cache_prompt=False,
                sampling=Sampling(seed=1000 + seq, ignore_eos=True))
                for seq in range(n_slots)]
            slots = [engine.start(seq, ActiveJob(
                messages.Submit(f"{rnd}-{way}-{seq}", request),
                lambda _frame: None, settings))
                for seq, request in enumerate(requests)]
            if way == "backend":
                for slot in slots:
                    if not llama_cpp.llama_set_sampler(ctx, slot.seq,
                                                       slot.sampler.sampler):
                        raise SystemExit("llama_set_sampler refused the chain")
            indices = engine.decode([(slot, *slot.prompt_chunk(engine.n_batch))
                                     for slot in slots])
            generated = []
            for step in range(n_tokens):
                started = time.perf_counter()
                last = sample(way, list(zip(slots, indices, strict=True)))
                sampled = time.perf_counter()
                indices = engine.decode([(slot, [token], True)
                                         for slot, token in zip(slots, last)])
                generated.append(last)
                if rnd and step:  # a step after a sampler change re-plans the graph
                    sample_ms[way].append(1000 * (sampled - started))
                    decode_ms[way].append(1000 * (time.perf_counter() - sampled))
            if rnd == 1:
                tokens[way] = generated
            for slot in slots:
                if way == "backend":
                    llama_cpp.llama_set_sampler(ctx, slot.seq, None)
                slot.close()
    helpers.shutdown()
    results.put({way: {
        "decode_ms": statistics.median(decode_ms[way]),
        "sample_ms": statistics.median(sample_ms[way]),
        "tokens_per_s": n_slots * len(decode_ms[way]) / (
            sum(decode_ms[way]) + sum(sample_ms[way])) * 1000,
        "same_tokens_as_serial": tokens[way] == tokens["serial"],
    } for way in WAYS})


def measure(model: str, n_slots: int, n_threads: int, prompt: str,
            n_tokens: int, rounds: int, flash_attn: bool) -> dict:
    """Each way's medians, in a child process (its own llama.cpp threads)."""
    return harness.in_child(_run, model, n_slots, n_threads, prompt, n_tokens,
                            rounds, flash_attn)


def main(argv: list[str] | None = None) -> int:
    from tests.bench.bench_throughput import PROMPT

    parser = harness.batched_engine_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    outcome = measure(args.model or harness.default_model(), args.slots,
                      args.threads, PROMPT, args.tokens, args.rounds,
                      args.flash_attn == "on")
    print(f"{args.slots} slots, {args.threads} threads, {args.rounds} rounds of "
          f"{args.tokens} steps, medians per step:\n")
    print("| way | decode ms | sampling ms | tokens/s | tokens as serial |")
    print("|---|---|---|---|---|")
    for way, row in outcome.items():
        print(f"| {way} | {row['decode_ms']:.2f} | {row['sample_ms']:.3f} | "
              f"{row['tokens_per_s']:.1f} | {row['same_tokens_as_serial']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
