"""What the pool costs one stream: HTTP -> broker -> worker -> SSE vs in-process.

    make bench-overhead            # or: python -m tests.bench.bench_overhead

One ``llamapool up --workers 1`` and one in-process ``Llama`` on the same
model, thread count and prompt; ``ignore_eos`` so both produce exactly
``--tokens`` tokens. The two run alternately, several times, so drift on a
shared machine hits both sides alike. Both reuse the prompt's KV-cache prefix
the same way (``workers.model.kv_cache``), so TTFT compares like with like.
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness

PROMPT = "The history of the llama begins in the high Andes, where"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int,
                        default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 repetitions of 32 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.reps = 32, 2
    model = args.model or harness.default_model()

    llama = harness.load_llama(model, args.threads)
    processors = harness.ban_eog(llama)
    server, url = harness.llamapool_up(model, workers=1, threads=args.threads)
    pool_runs, local_runs = [], []
    try:
        # One warm-up each: page in the weights, fill the prefix cache.
        harness.stream_once(url, PROMPT, 4)
        harness.generate_loop(llama, PROMPT, 4, processors)
        for _ in range(args.reps):
            pool_runs.append(harness.stream_once(url, PROMPT, args.tokens))
            local_runs.append(harness.generate_loop(llama, PROMPT, args.tokens,
                                                    processors))
    finally:
        server.stop()

    def med(runs, attr):
        return harness.median([getattr(r, attr) for r in runs])

    pool_tps, local_tps = (med(pool_runs, "decode_tokens_per_s"),
                           med(local_runs, "decode_tokens_per_s"))
    pool_ttft, local_ttft = med(pool_runs, "ttft_s"), med(local_runs, "ttft_s")
    pool_e2e = harness.median([r.tokens / r.total_s for r in pool_runs])
    local_e2e = harness.median([r.tokens / r.total_s for r in local_runs])
    print(f"## Overhead of one stream ({os.path.basename(model)}, {args.threads} "
          f"thread(s), {args.tokens} tokens, ignore_eos, median of {args.reps} "
          "alternating runs)\n")
    print(harness.md_table(
        ["", "llamapool up (HTTP+broker+worker+SSE)", "Llama.generate in-process",
         "ratio pool / in-process"],
        [
            ["decode tokens/s", pool_tps, local_tps,
             harness.ratio(pool_tps, local_tps)],
            ["end-to-end tokens/s", pool_e2e, local_e2e,
             harness.ratio(pool_e2e, local_e2e)],
            ["TTFT p50 ms", pool_ttft * 1000, local_ttft * 1000,
             harness.ratio(pool_ttft, local_ttft)],
        ],
    ))
    print(f"\nTTFT added by the pool at p50: {(pool_ttft - local_ttft) * 1000:.1f} ms")
    tokens = {r.tokens for r in pool_runs} | {r.tokens for r in local_runs}
    if tokens != {args.tokens}:
        print(f"\nwarning: token counts differ from {args.tokens}: {sorted(tokens)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
