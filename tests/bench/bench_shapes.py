"""The pool shapes ``llamapool up`` may choose, against llama-server, at
concurrency 1, 2 and 4 in interleaved rounds.

    make bench-shapes   # or: python -m tests.bench.bench_shapes [--rounds 3]

``up`` picks its shape by CPU (``llamapool/pool_shape.py``): two one-slot
workers with ``--threads auto``, or one worker of two batched slots. Which
pays depends on the hardware, and ``make bench-throughput`` runs its targets
minutes apart, through this shared machine's drift; here every target is up
at once (an idle one costs no CPU) and each round runs each at concurrency
1, 2 and 4 (at 4, refused clients ask again after 0.05 s) in a rotating
order. Every target runs at its own default settings (flash attention on in
both servers). Printed: the median tokens/s per target and level, its median
per-round ratio to llama-server and to the fixed one-thread workers (the
default before issue 32), and TTFT p50/p99 over all rounds.
"""

from __future__ import annotations

import contextlib
import os
import statistics

from llamapool.loadgen import percentile
from tests.bench import harness
from tests.bench.bench_throughput import PROMPT
from workers.model.weight_repack import cpu_has_amx

LEVELS = (1, 2, 4)
FIXED = "llamapool up (2 workers × 1 thread)"
# On AMX the vendored llama.cpp's repacked Q4_K matmul crashes: both sides
# without repacking there, as the workers' --repack auto is.
NO_REPACK = ("--no-repack",) if cpu_has_amx() else ()
LLAMA_SERVER = " ".join(("llama-server -np 2 -t 2", *NO_REPACK))


def targets(model: str) -> dict:
    return {
        FIXED: lambda: harness.llamapool_up(model, workers=2, threads=1),
        "llamapool up (2 workers, --threads auto)": lambda: harness.llamapool_up(
            model, workers=2, threads="auto"),
        "llamapool up (1 worker × 2 batched slots)": lambda: harness.llamapool_up(
            model, workers=1, threads=os.cpu_count() or 1, slots_per_worker=2),
        LLAMA_SERVER: lambda: harness.llama_server(
            model, slots=2, n_threads=2, extra=NO_REPACK),
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.rounds_parser(__doc__, rounds=3)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS),
                        help="concurrency levels (default: 1 2 4)")
    args = parser.parse_args(argv)
    levels = tuple(args.levels)
    model = args.model or harness.default_model()
    starts = targets(model)
    with contextlib.ExitStack() as stack:
        urls = harness.start_warm(stack, starts, concurrency=max(levels), prompt=PROMPT)
        # A target's levels run together, one after another.
        rates, ttfts = harness.interleaved_rounds(
            urls, [[(name, c) for c in levels] for name in starts], args, PROMPT,
            wait_after_503_s=0.05)

    def per_round(name: str, against: str, c: int) -> float:
        return statistics.median(a / b for a, b in zip(rates[name, c], rates[against, c]))

    print(f"\n## Pool shapes, {args.rounds} interleaved rounds "
          f"({os.path.basename(model)}, {args.tokens} tokens, ignore_eos, "
          f"{args.duration:.0f} s per level, {harness.cpu_name()})\n")
    print(harness.md_table(
        ["target", "concurrency", "tokens/s (median)", "per round",
         "× llama-server (same round)", "× 2 workers × 1 thread (same round)",
         "TTFT p50 ms", "TTFT p99 ms"],
        [[name, c, statistics.median(rates[name, c]),
          " ".join(f"{v:.1f}" for v in rates[name, c]),
          per_round(name, LLAMA_SERVER, c), per_round(name, FIXED, c),
          1000 * percentile(ttfts[name, c], 50), 1000 * percentile(ttfts[name, c], 99)]
         for name in starts for c in levels]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
