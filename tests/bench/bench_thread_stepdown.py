"""What a second job costs the running one under ``--threads auto``.

    make bench-thread-stepdown   # or: python -m tests.bench.bench_thread_stepdown

Two workers with ``--threads auto --pool-cores 2`` on the default model. Each
round streams a long job A; once ``/slots`` shows it decoding with 2 threads,
a short job B starts on the other worker. A must drop to 1 thread before B
decodes: if it does not, A's threads and B's outnumber the cores, and
llama.cpp's threads wait for each other at every barrier.

Measured from the client: A's slowest token gap while B starts (from B's
request to 0.5 s after B's first token) against A's median gap, and B's TTFT.
Two pools in the same run, side by side: the broker holding B's SUBMIT until
A confirms its step-down (``--step-down-wait-s 0.25``, the default), and
sending it at once (``--step-down-wait-s 0``, what the first version did).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

from tests.bench import harness
from tests.pool import Pool, wait_until

PROMPT = "Write a short story about a llama."


#: Keep-alive connections for both streams (httpx.Client is thread-safe): a
#: new connection per request would add its setup to B's TTFT.
CLIENT = httpx.Client(timeout=600)


def stream(url: str, max_tokens: int, arrivals: list[float]) -> None:
    """A streamed completion; appends each token event's arrival time."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with CLIENT.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                arrivals.append(time.perf_counter())


def decoding_with(url: str, n_threads: int) -> bool:
    with urllib.request.urlopen(url + "/slots", timeout=5) as resp:
        slots = json.loads(resp.read())
    return any(s["is_processing"] and s["n_decoded"] > 0
               and s["n_threads"] == n_threads for s in slots)


def one_round(url: str) -> tuple[float, float, float]:
    """(A's median gap, A's worst gap while B starts, B's TTFT), seconds."""
    a_times: list[float] = []
    long_job = threading.Thread(target=stream, args=(url, 200, a_times))
    long_job.start()
    wait_until(lambda: decoding_with(url, 2), 120,
               "the long job decoding with 2 threads")
    b_times: list[float] = []
    b_started = time.perf_counter()
    stream(url, 16, b_times)
    long_job.join()
    window_end = b_times[0] + 0.5
    gaps = [b - a for a, b in zip(a_times, a_times[1:])]
    during = [b - a for a, b in zip(a_times, a_times[1:])
              if b >= b_started and a <= window_end]
    return statistics.median(gaps), max(during), b_times[0] - b_started


def measure(model: Path, wait_s: float, rounds: int) -> list[object]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-stepdown-"))
    pool = Pool(model, run_dir, workers=2,
                worker_args=("--threads", "auto", "--pool-cores", "2"),
                broker_args=("--step-down-wait-s", str(wait_s)))
    try:
        stream(pool.url, 4, [])  # warm-up
        results = [one_round(pool.url) for _ in range(rounds)]
        pool.assert_whole(60)
    finally:
        pool.stop()
    median_gap = statistics.median(r[0] for r in results) * 1000
    worst = sorted(r[1] * 1000 for r in results)
    ttft = sorted(r[2] * 1000 for r in results)
    return [f"{wait_s:g}", rounds, median_gap, worst[len(worst) // 2], worst[-1],
            ttft[len(ttft) // 2], ttft[-1]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    model = Path(args.model or harness.default_model())
    rows = [measure(model, wait_s, args.rounds) for wait_s in (0.25, 0.0)]
    print(f"## A second job landing next to a running one ({model.name}, 2 "
          f"workers, --threads auto, --pool-cores 2, {args.rounds} rounds)\n")
    print(harness.md_table(
        ["--step-down-wait-s", "rounds", "A's median token gap ms",
         "A's worst gap as B starts, p50 ms", "max ms", "B's TTFT p50 ms",
         "max ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
