"""Memory per worker: RSS and PSS with 1, 2 and 4 workers on one machine.

    make bench-memory   # or: python -m tests.bench.bench_memory

Each worker maps the GGUF read-only, so the weights' pages are shared
between workers: RSS counts them in every worker, PSS (proportional set
size, from ``/proc/PID/smaps_rollup``) splits them among the sharers. PSS
summed over the workers is what the pool really costs. Every worker serves
one request first, so its weights are paged in and its KV cache touched.
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness


def rollup_kib(pid: int) -> dict[str, int]:
    """``Rss``, ``Pss`` and friends from smaps_rollup, in KiB."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def measure(model: str, workers: int, ctx: int) -> dict:
    server, url = harness.llamapool_up(model, workers=workers, threads=1, ctx=ctx)
    try:
        report = harness.run_load(url, concurrency=workers, requests=workers,
                                  max_tokens=8, ignore_eos=True)
        if report["requests_completed"] != workers:
            raise RuntimeError(f"warm-up failed: {report}")
        rollups = [rollup_kib(pid) for pid in harness.slot_pids(url)]
    finally:
        server.stop()
    mib = 1024
    return {
        "rss": [r["Rss"] / mib for r in rollups],
        "pss": [r["Pss"] / mib for r in rollups],
        "shared": [(r.get("Shared_Clean", 0) + r.get("Shared_Dirty", 0)) / mib
                   for r in rollups],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 and 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers = [1, 2]
    model = args.model or harness.default_model()

    rows = []
    baseline_pss = None
    for n in args.workers:
        m = measure(model, n, args.ctx)
        rss, pss = sum(m["rss"]) / n, sum(m["pss"]) / n
        baseline_pss = baseline_pss or pss
        rows.append([n, rss, pss, sum(m["shared"]) / n, sum(m["pss"]),
                     harness.ratio(pss, rss), harness.ratio(pss, baseline_pss)])
    size_mib = os.path.getsize(model) / 2**20
    print(f"## Memory per worker ({os.path.basename(model)}, {size_mib:.0f} MiB "
          f"file, ctx {args.ctx}, after one request each)\n")
    print(harness.md_table(
        ["workers", "RSS MiB / worker", "PSS MiB / worker", "shared MiB / worker",
         "PSS MiB total", "PSS / RSS", "PSS / worker vs 1 worker"],
        rows,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
