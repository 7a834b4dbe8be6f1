"""One broker vs two, side by side, and what a broker kill costs.

    make bench-brokers   # or: python -m tests.bench.bench_brokers [--quick]

The same pool (synthetic workers, one gunicorn frontend, real processes over
``ipc://``) is run behind 1 broker and behind 2 (the workers spread over
them), under the same closed-loop load: C clients, each streaming
completions of M tokens back to back. For each:

* frames/s: TOKEN frames relayed to the clients (SSE events with text);
* TTFT p50 / p99 (request sent to first token event), over the steady phase;
* then ``kill -9`` of broker 0 mid-load, and the time from the kill until
  the clients' throughput (0.25 s windows) is back to 80 % of its steady
  rate, with the streams lost and the requests refused (503) from the kill
  on. With one broker, nothing serves until the broker is back: it is
  restarted at once (the best case of ``Restart=on-failure``), so its figure
  is the time to restart and re-register. With two, nothing is restarted:
  the other broker takes the dead one's workers. The "host lost" row is
  one broker that does not come back (its host is down).

All numbers come from one run on one machine; the load generator shares it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.bench import harness
from tests.brokers_pool import BrokersPool
from tests.pool import wait_until

WINDOW_S = 0.25
BACK_FRACTION = 0.8


class Load:
    """C client threads streaming completions back to back."""

    def __init__(self, url: str, concurrency: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.token_times: list[float] = []
        self.ttft: list[tuple[float, float]] = []  # (sent at, ttft)
        self.outcomes: list[tuple[float, str]] = []  # (sent at, outcome)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self) -> None:
        body = {"prompt": "x", "max_tokens": self.max_tokens, "stream": True}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                outcome = "cut"
                try:
                    with client.stream("POST", self.url + "/v1/completions",
                                       json=body) as r:
                        if r.status_code != 200:
                            r.read()
                            outcome = str(r.status_code)
                        else:
                            first = True
                            for line in r.iter_lines():
                                if line.startswith('data: {"error'):
                                    outcome = "error"
                                elif line.startswith("data: {"):
                                    now = time.monotonic()
                                    with self._lock:
                                        self.token_times.append(now)
                                        if first:
                                            self.ttft.append((sent, now - sent))
                                    first = False
                                elif line == "data: [DONE]":
                                    outcome = "ok"
                except httpx.HTTPError:
                    outcome = "transport"
                with self._lock:
                    self.outcomes.append((sent, outcome))
                if outcome == "503":
                    time.sleep(0.05)  # the hint is >= 1 s; do not spin


def rate(times: list[float], start: float, end: float) -> float:
    return sum(1 for t in times if start <= t < end) / max(end - start, 1e-9)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(n_brokers: int, args, run_dir: Path, restart: bool = True) -> dict:
    worker_args = ("--engine", "synthetic", "--tokens-per-second",
                   str(args.tokens_per_s))
    pool = BrokersPool(run_dir, n_brokers=n_brokers, n_workers=args.workers,
                       worker_args=worker_args,
                       heartbeat=["--heartbeat-interval-s", str(args.heartbeat_s),
                                  "--heartbeat-liveness", "3"])
    try:
        load = Load(pool.url, args.concurrency, args.max_tokens)
        load.start()
        # gunicorn's threads and the links start on the first requests: the
        # warm-up counts from the first token.
        wait_until(lambda: load.token_times, 120, "the first token")
        time.sleep(args.warmup_s)  # a benchmark's warm-up, not synchronisation
        steady_from = time.monotonic()
        time.sleep(args.steady_s)
        killed_at = time.monotonic()
        steady = rate(load.token_times, steady_from, killed_at)
        ttfts = [t for sent, t in load.ttft if steady_from <= sent < killed_at]
        pool.brokers[0].kill()
        if n_brokers == 1 and restart:
            pool.restart_broker(0)
        time.sleep(args.after_s)
        load.stop()
        end = time.monotonic()
        back_at = None
        t = killed_at
        while t + WINDOW_S <= end:
            if rate(load.token_times, t, t + WINDOW_S) >= BACK_FRACTION * steady:
                back_at = t + WINDOW_S
                break
            t += WINDOW_S / 5
        return {
            "brokers": n_brokers,
            "frames_s": steady,
            "ttft_p50_ms": 1000 * (percentile(ttfts, 0.5) or 0),
            "ttft_p99_ms": 1000 * (percentile(ttfts, 0.99) or 0),
            "back_s": None if back_at is None else back_at - killed_at,
            # Nothing fails before the kill in a healthy pool: every stream
            # that ended badly was one the kill cut.
            "lost": sum(1 for _, o in load.outcomes
                        if o in ("error", "cut", "transport")),
            "refused": sum(1 for sent, o in load.outcomes
                           if sent >= killed_at and o == "503"),
        }
    finally:
        pool.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tokens-per-s", type=float, default=100.0)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--heartbeat-s", type=float, default=0.2)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="short phases")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup_s, args.steady_s, args.after_s = 1.5, 4.0, 5.0
    rows = []
    cases = [(1, True, "1 (restarted at once)"), (1, False, "1 (host lost)"),
             (2, False, "2")]
    for n, restart, label in cases:
        with tempfile.TemporaryDirectory(prefix="bench-brokers-") as d:
            r = run(n, args, Path(d), restart)
        rows.append([label, f"{r['frames_s']:.0f}", f"{r['ttft_p50_ms']:.0f}",
                     f"{r['ttft_p99_ms']:.0f}",
                     "never" if r["back_s"] is None else f"{r['back_s']:.2f}",
                     r["lost"], r["refused"]])
        print(f"done: {label}", file=sys.stderr)
    print(f"{args.workers} synthetic workers at {args.tokens_per_s:g} tok/s, "
          f"{args.concurrency} clients streaming {args.max_tokens} tokens, "
          f"heartbeat {args.heartbeat_s:g} s x 3; kill -9 of broker 0\n")
    print(harness.md_table(
        ["brokers", "frames/s", "TTFT p50 ms", "TTFT p99 ms",
         "kill to 80% throughput s", "streams lost", "503 after kill"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
