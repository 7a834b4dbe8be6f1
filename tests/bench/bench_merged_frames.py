"""Frames merged while the client is behind, against one event per frame,
on a frontend that cannot keep up with its workers (issue 32, point 4).

    make bench-merged-frames   # or: python -m tests.bench.bench_merged_frames

One broker, ``--workers`` synthetic workers (a stand-in engine with no
model: this measures the frontend, not a model) each emitting
``--tokens-per-s``, and two frontends on that broker, both one gunicorn
process: one at the default ``--merge-waiting-frames`` (64), one at 1 (each
frame its own event, as before). ``--concurrency`` closed-loop clients
stream ``--tokens``-token completions from one frontend, then the other, in
interleaved rounds. Printed per frontend: tokens/s delivered, events per
token, the frontend's CPU per token, TTFT p50 and p99.

A frontend that keeps up finds no frame waiting and sends each as it came,
so at a rate it can carry the two read the same; merging shows only where
the frontend falls behind its workers.
"""

from __future__ import annotations

import os
import statistics
import tempfile

from llamapool import loadgen
from tests.bench import harness
from tests.bench.bench_broker import cli, start_broker, start_workers, stop_all, wait_slots
from tests.pool import free_port

SETTING = "LLAMAPOOL_MERGE_WAITING_FRAMES"


def start_frontend(front: str, merge: int, threads: int) -> tuple[harness.Server, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, SETTING: str(merge), "LLAMAPOOL_FRONTEND_PROCESSES": "1",
           "LLAMAPOOL_FRONTEND_THREADS": str(threads)}
    return harness.Server(f"frontend-merge-{merge}", cli(
        "frontend", "--broker", front, "--bind", f"127.0.0.1:{port}"),
        url + "/health", env=env), url


def main(argv: list[str] | None = None) -> int:
    parser = harness.rounds_parser(__doc__, rounds=6)
    parser.add_argument("--workers", type=int, default=4,
                        help="synthetic workers (slots) behind the broker")
    parser.add_argument("--tokens-per-s", type=float, default=1000.0,
                        help="each synthetic worker's rate")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed-loop clients (default: --workers)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds of 3 s")
    parser.add_argument("--threads", type=int, default=16,
                        help="gunicorn threads of each frontend's one process")
    parser.set_defaults(tokens=256)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 2, 3.0
    concurrency = args.concurrency or args.workers
    merges = (64, 1)
    runs: dict[int, list[dict]] = {m: [] for m in merges}
    with tempfile.TemporaryDirectory() as run_dir:
        broker, front, back = start_broker(run_dir)
        servers = [*start_workers(args.workers, back, args.tokens_per_s), broker]
        try:
            wait_slots(front, args.workers)
            frontends = {}
            for merge in merges:
                server, url = start_frontend(front, merge, args.threads)
                servers.insert(0, server)
                frontends[merge] = (server, url)
                harness.run_load(url, concurrency=concurrency, requests=concurrency,
                                 max_tokens=8)  # warm-up: the threads, the link
            for r in range(args.rounds):
                for merge in merges if r % 2 == 0 else merges[::-1]:
                    server, url = frontends[merge]
                    cpu_before = harness.tree_cpu_seconds(server.pid)
                    config = loadgen.BenchConfig(
                        base_url=url, concurrency=concurrency, requests=None,
                        duration_s=args.duration, max_tokens=args.tokens,
                        wait_after_503_s=0.05)
                    results, wall_s = loadgen.run_requests(config)
                    cpu_s = harness.tree_cpu_seconds(server.pid) - cpu_before
                    ok = [x for x in results if x.ok]
                    tokens = sum(x.output_tokens for x in ok)
                    runs[merge].append({
                        "tokens_per_s": tokens / wall_s,
                        "events_per_token": sum(x.text_chunks for x in ok) / max(1, tokens),
                        "cpu_ms_per_token": 1000 * cpu_s / max(1, tokens),
                        "ttfts": [x.ttft_s for x in ok if x.ttft_s is not None],
                        "failed": len(results) - len(ok),
                    })
                    print(f"round {r + 1}, merge {merge}: "
                          f"{runs[merge][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        finally:
            stop_all(servers)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[64], runs[1])]
    print(f"\n## Merged frames against one event per frame: {args.workers} synthetic "
          f"workers × {args.tokens_per_s:.0f} tokens/s, concurrency {concurrency}, "
          f"{args.tokens} tokens per request, one frontend process × {args.threads} "
          f"threads each, {args.rounds} interleaved rounds of {args.duration:.0f} s "
          f"({harness.cpu_name()})\n")
    rows = []
    for merge in merges:
        rs = runs[merge]
        ttfts = [t for x in rs for t in x["ttfts"]]
        rows.append([f"--merge-waiting-frames {merge}",
                     statistics.median(x["tokens_per_s"] for x in rs),
                     " ".join(f"{x['tokens_per_s']:.0f}" for x in rs),
                     statistics.median(x["events_per_token"] for x in rs),
                     statistics.median(x["cpu_ms_per_token"] for x in rs),
                     1000 * loadgen.percentile(ttfts, 50),
                     1000 * loadgen.percentile(ttfts, 99),
                     sum(x["failed"] for x in rs)])
    rows.append(["ratio, 64 / 1 (same round)", statistics.median(ratios),
                 " ".join(f"{v:.2f}" for v in ratios), "", "", "", "", ""])
    print(harness.md_table(
        ["frontend", "tokens/s, median", "per round", "events per token",
         "frontend CPU ms per token", "TTFT p50 ms", "p99", "failed"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
