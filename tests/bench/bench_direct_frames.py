"""What frames that skip the broker would be worth, on the floor, before
anyone builds them (issue 32, point 4).

    make bench-direct-frames   # or: python -m tests.bench.bench_direct_frames

Building it into llamapool changes the CURVE key layout (workers would
connect to every frontend) and the firewall (worker hosts to frontend
hosts), so it is weighed first on the floor (``tests/bench/floor_pool.py``:
the pool's processes and hops, none of its code), with and without
``--direct``. Two shapes, each at the concurrency it serves: one worker of
two threads at c=1 (what ``--threads auto`` gives a lone stream), two
workers of one thread at c=2. llama-server ``-np 2 -t 2`` and ``llamapool up
--threads auto`` (the EPYC's default shape) run in the same rounds, at both
levels, for scale. Every target is up at once and each round runs each in a
rotating order. Printed: median tokens/s, the median per-round ratio to
llama-server and to the relayed floor of the same shape, TTFT p50/p99.
"""

from __future__ import annotations

import contextlib
import os
import statistics

from llamapool.loadgen import percentile
from tests.bench import harness
from tests.bench.bench_shapes import LLAMA_SERVER, NO_REPACK
from tests.bench.bench_throughput import PROMPT

RELAYED, DIRECT = "floor, frames through the broker", "floor, frames straight to the frontend"
#: The floor's shape at each level: (workers, threads per worker).
FLOOR_SHAPE = {1: (1, 2), 2: (2, 1)}


def targets(model: str) -> dict:
    """name -> (start, levels it runs at)."""
    out = {LLAMA_SERVER: (lambda: harness.llama_server(
               model, slots=2, n_threads=2, extra=NO_REPACK), (1, 2)),
           "llamapool up (2 workers, --threads auto)": (lambda: harness.llamapool_up(
               model, workers=2, threads="auto"), (1, 2))}
    for c, (workers, threads) in FLOOR_SHAPE.items():
        for name, direct in ((RELAYED, False), (DIRECT, True)):
            out[floor_name(name, c)] = (
                lambda w=workers, t=threads, d=direct: harness.floor_pool(
                    model, w, threads=t, direct=d), (c,))
    return out


def floor_name(name: str, c: int) -> str:
    workers, threads = FLOOR_SHAPE[c]
    return f"{name} ({workers} × {threads} thread{'s' if threads > 1 else ''})"


def main(argv: list[str] | None = None) -> int:
    parser = harness.rounds_parser(__doc__, rounds=5)
    args = parser.parse_args(argv)
    model = args.model or harness.default_model()
    plan = targets(model)
    with contextlib.ExitStack() as stack:
        urls = harness.start_warm(stack, {n: start for n, (start, _) in plan.items()},
                                  concurrency=2, prompt=PROMPT)
        rates, ttfts = harness.interleaved_rounds(
            urls, [[(n, c)] for n, (_, levels) in plan.items() for c in levels],
            args, PROMPT)

    def per_round(run: tuple[str, int], against: tuple[str, int]) -> float:
        return statistics.median(a / b for a, b in zip(rates[run], rates[against]))

    print(f"\n## Frames through the broker or straight to the frontend, {args.rounds} "
          f"interleaved rounds ({os.path.basename(model)}, {args.tokens} tokens, "
          f"ignore_eos, {args.duration:.0f} s per level, {harness.cpu_name()})\n")
    print(harness.md_table(
        ["concurrency", "target", "tokens/s (median)", "per round",
         "× llama-server (same round)", "× relayed floor (same round)",
         "TTFT p50 ms", "TTFT p99 ms"],
        [[c, name, statistics.median(rates[name, c]),
          " ".join(f"{v:.1f}" for v in rates[name, c]),
          per_round((name, c), (LLAMA_SERVER, c)),
          per_round((name, c), (floor_name(RELAYED, c), c)),
          1000 * percentile(ttfts[name, c], 50), 1000 * percentile(ttfts[name, c], 99)]
         for c in FLOOR_SHAPE for name, (_, levels) in plan.items() if c in levels]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
