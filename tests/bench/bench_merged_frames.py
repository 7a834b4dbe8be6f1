"""Frames merged while the client is behind, against one event per frame
(issue 32, point 4: vLLM's ``--stream-interval``, only while behind).

    make bench-merged-frames   # or: python -m tests.bench.bench_merged_frames

One broker, ``--workers`` synthetic workers (a stand-in engine with no
model: this measures the frontend, not a model) and two frontends on that
broker, both one gunicorn process: one at ``--merge-waiting-frames 64``,
one at 1 (each frame its own event: the default). Each round runs the same load against one frontend, then the
other, in interleaved rounds. Two loads:

1. **Slow links**: ``--slow-clients`` clients, each reading its stream at
   most ``--link-kib-per-s`` (a phone on a poor network), ``--slow-tokens``
   tokens per request from workers at ``--slow-tokens-per-s`` (about a
   model's speed). A token costs the link a whole event (some 270 bytes of
   OpenAI chunk for a few bytes of text) unless it is merged: printed, the
   time until each request's last byte (which is about how long its slot is
   held: past the credit window the worker waits for the client), tokens/s
   per client, and bytes per token.
2. **A frontend behind its workers**: ``--concurrency`` closed-loop clients
   that read at once, ``--tokens`` per request, workers at ``--tokens-per-s``
   each: tokens/s delivered, events per token, the frontend's CPU per
   token, TTFT.

A frontend that keeps up finds no frame waiting and sends each as it came,
so where neither the client nor the frontend is behind the two are the same.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import statistics
import tempfile
import time

from llamapool import loadgen
from tests.bench import harness
from tests.bench.bench_broker import cli, start_broker, start_workers, stop_all, wait_slots
from tests.pool import free_port

SETTING = "LLAMAPOOL_MERGE_WAITING_FRAMES"
MERGES = (64, 1)


def start_frontend(front: str, merge: int, threads: int) -> tuple[harness.Server, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, SETTING: str(merge), "LLAMAPOOL_FRONTEND_PROCESSES": "1",
           "LLAMAPOOL_FRONTEND_THREADS": str(threads)}
    return harness.Server(f"frontend-merge-{merge}", cli(
        "frontend", "--broker", front, "--bind", f"127.0.0.1:{port}"),
        url + "/health", env=env), url


def slow_link_stream(port: int, max_tokens: int, bytes_per_s: float) -> dict:
    """One streamed completion read at most ``bytes_per_s`` (the client's
    pacing is the load being modelled, not a wait for the server): seconds
    to its last byte, its tokens (from the usage chunk), bytes and events."""
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sock = socket.socket()
    # A small receive window, as a slow link's: the frontend's writes block
    # soon after the client falls behind.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sock.settimeout(120)
    started = time.perf_counter()
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    try:
        while not data.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(1024)
            if not chunk:
                break
            data += chunk
            ahead_s = len(data) / bytes_per_s - (time.perf_counter() - started)
            if ahead_s > 0:
                time.sleep(ahead_s)
    finally:
        sock.close()
    events = [line[len(b"data: "):] for line in data.split(b"\n")
              if line.startswith(b"data: {")]
    usage = json.loads(events[-1]).get("usage") or {}
    return {"seconds": time.perf_counter() - started,
            "tokens": usage.get("completion_tokens", 0),
            "bytes": len(data), "events": len(events)}


def slow_links(url: str, clients: int, max_tokens: int, bytes_per_s: float) -> dict:
    port = int(url.rsplit(":", 1)[1])
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda _: slow_link_stream(port, max_tokens, bytes_per_s),
                             range(clients)))
    tokens = sum(r["tokens"] for r in runs)
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "bytes_per_token": sum(r["bytes"] for r in runs) / max(1, tokens),
            "events_per_token": sum(r["events"] for r in runs) / max(1, tokens),
            "short": sum(1 for r in runs if r["tokens"] != max_tokens)}


def behind_workers(url: str, server: harness.Server, args) -> dict:
    cpu_before = harness.tree_cpu_seconds(server.pid)
    config = loadgen.BenchConfig(
        base_url=url, concurrency=args.concurrency, requests=None,
        duration_s=args.duration, max_tokens=args.tokens, wait_after_503_s=0.05)
    results, wall_s = loadgen.run_requests(config)
    cpu_s = harness.tree_cpu_seconds(server.pid) - cpu_before
    ok = [x for x in results if x.ok]
    tokens = sum(x.output_tokens for x in ok)
    return {"tokens_per_s": tokens / wall_s,
            "events_per_token": sum(x.text_chunks for x in ok) / max(1, tokens),
            "cpu_ms_per_token": 1000 * cpu_s / max(1, tokens),
            "ttfts": [x.ttft_s for x in ok if x.ttft_s is not None],
            "failed": len(results) - len(ok)}


def interleaved(frontends: dict, rounds: int, measure) -> dict[int, list[dict]]:
    """``measure(url, server)`` for each frontend in each round, the order
    alternating from round to round."""
    runs: dict[int, list[dict]] = {m: [] for m in MERGES}
    for r in range(rounds):
        for merge in MERGES if r % 2 == 0 else MERGES[::-1]:
            server, url = frontends[merge]
            runs[merge].append(measure(url, server))
            print(f"round {r + 1}, merge {merge}: {runs[merge][-1]}"[:160], flush=True)
    return runs


def with_pool(n_workers: int, tokens_per_s: float, threads: int, measure,
              rounds: int) -> dict[int, list[dict]]:
    with tempfile.TemporaryDirectory() as run_dir:
        broker, front, back = start_broker(run_dir)
        servers = [*start_workers(n_workers, back, tokens_per_s), broker]
        try:
            wait_slots(front, n_workers)
            frontends = {}
            for merge in MERGES:
                server, url = start_frontend(front, merge, threads)
                servers.insert(0, server)
                frontends[merge] = (server, url)
                harness.run_load(url, concurrency=n_workers, requests=n_workers,
                                 max_tokens=8)  # warm-up: the threads, the link
            return interleaved(frontends, rounds, measure)
        finally:
            stop_all(servers)


def same_round(runs: dict[int, list[dict]], key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(runs[MERGES[0]], runs[MERGES[1]])]


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in runs)


def main(argv: list[str] | None = None) -> int:
    parser = harness.rounds_parser(__doc__, rounds=6)
    parser.add_argument("--workers", type=int, default=8,
                        help="synthetic workers (slots) for the frontend-behind load")
    parser.add_argument("--tokens-per-s", type=float, default=2000.0,
                        help="each synthetic worker's rate, frontend-behind load")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed-loop clients (default: --workers)")
    parser.add_argument("--threads", type=int, default=16,
                        help="gunicorn threads of each frontend's one process")
    parser.add_argument("--slow-clients", type=int, default=2)
    parser.add_argument("--link-kib-per-s", type=float, default=8.0)
    parser.add_argument("--slow-tokens", type=int, default=1024)
    parser.add_argument("--slow-tokens-per-s", type=float, default=50.0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds of 3 s, 300 slow tokens")
    parser.set_defaults(tokens=256)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.slow_tokens = 2, 3.0, 300
    args.concurrency = args.concurrency or args.workers
    cpu = harness.cpu_name()

    slow = with_pool(args.slow_clients, args.slow_tokens_per_s, args.threads,
                     lambda url, _server: slow_links(url, args.slow_clients,
                                                     args.slow_tokens,
                                                     args.link_kib_per_s * 1024),
                     args.rounds)
    print(f"\n## Slow links: {args.slow_clients} clients reading at most "
          f"{args.link_kib_per_s:g} KiB/s each, {args.slow_tokens} tokens per request "
          f"from synthetic workers at {args.slow_tokens_per_s:g} tokens/s, "
          f"{args.rounds} interleaved rounds ({cpu})\n")
    print(harness.md_table(
        ["frontend", "seconds to the last byte, median", "tokens/s per client",
         "bytes per token", "events per token", "requests cut short"],
        [*([f"--merge-waiting-frames {m}", median_of(slow[m], "seconds"),
            median_of(slow[m], "tokens_per_s"), median_of(slow[m], "bytes_per_token"),
            median_of(slow[m], "events_per_token"), sum(x["short"] for x in slow[m])]
           for m in MERGES),
         ["ratio, 64 / 1 (same round), median",
          statistics.median(same_round(slow, "seconds")),
          statistics.median(same_round(slow, "tokens_per_s")),
          statistics.median(same_round(slow, "bytes_per_token")), "", ""]]))

    behind = with_pool(args.workers, args.tokens_per_s, args.threads,
                       lambda url, server: behind_workers(url, server, args),
                       args.rounds)
    print(f"\n## A frontend behind its workers: {args.workers} synthetic workers × "
          f"{args.tokens_per_s:.0f} tokens/s, concurrency {args.concurrency}, "
          f"{args.tokens} tokens per request, one frontend process × {args.threads} "
          f"threads each, {args.rounds} interleaved rounds of {args.duration:.0f} s "
          f"({cpu})\n")
    rows = []
    for merge in MERGES:
        rs = behind[merge]
        ttfts = [t for x in rs for t in x["ttfts"]]
        rows.append([f"--merge-waiting-frames {merge}", median_of(rs, "tokens_per_s"),
                     " ".join(f"{x['tokens_per_s']:.0f}" for x in rs),
                     median_of(rs, "events_per_token"), median_of(rs, "cpu_ms_per_token"),
                     1000 * loadgen.percentile(ttfts, 50),
                     1000 * loadgen.percentile(ttfts, 99),
                     sum(x["failed"] for x in rs)])
    ratios = same_round(behind, "tokens_per_s")
    rows.append(["ratio, 64 / 1 (same round)", statistics.median(ratios),
                 " ".join(f"{v:.2f}" for v in ratios), "", "", "", "", ""])
    print(harness.md_table(
        ["frontend", "tokens/s, median", "per round", "events per token",
         "frontend CPU ms per token", "TTFT p50 ms", "p99", "failed"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
