"""How soon a running ``--threads auto`` worker steps down when a second job
lands on its host (and back up when that job ends).

    make bench-thread-stepdown   # or: python -m tests.bench.bench_thread_stepdown

Two workers with ``--threads auto --pool-cores 2`` on the default model. Each
round streams a long job A; once ``/slots`` shows it decoding with 2 threads,
a short job B starts on the other worker. The worker logs (at debug) when it
switched and how long after the broker's THREADS arrived: for a running job
that is the rest of the decode that was in flight, i.e. how long the host was
oversubscribed. Prints p50 and max for the step-down and the step-up.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import urllib.request
from pathlib import Path

from tests.bench import harness
from tests.pool import TEST_HEARTBEAT, Pool, Proc, cli, wait_until

SWITCH = re.compile(r"threads (\d+) -> (\d+) mid-job, ([\d.]+) ms after THREADS")


class DebugLogPool(Pool):
    """Workers log at debug level (the switch lines)."""

    def start_worker(self) -> Proc:
        self._worker_serial += 1
        proc = Proc(
            f"worker{self._worker_serial}",
            cli("--log-level", "debug", "worker", "--broker", self.workers_ep,
                "--model", str(self.model_path), "--ctx", "2048",
                *TEST_HEARTBEAT, *self.worker_args),
            self.run_dir,
        )
        self.workers.append(proc)
        return proc


def complete(url: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": "Write a short story about a llama.",
                       "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def decoding_with(url: str, n_threads: int) -> bool:
    with urllib.request.urlopen(url + "/slots", timeout=5) as resp:
        slots = json.loads(resp.read())
    return any(s["is_processing"] and s["n_decoded"] > 0
               and s["n_threads"] == n_threads for s in slots)


def percentile_50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    model = args.model or harness.default_model()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-stepdown-"))
    pool = DebugLogPool(Path(model), run_dir, workers=2,
                        worker_args=("--threads", "auto", "--pool-cores", "2"))
    try:
        for _ in range(args.rounds):
            long_job = threading.Thread(target=complete, args=(pool.url, 160))
            long_job.start()
            wait_until(lambda: decoding_with(pool.url, 2), 120,
                       "the long job decoding with 2 threads")
            complete(pool.url, 16)
            long_job.join()
            pool.assert_whole(60)
        logs = "".join(p.log_path.read_text(errors="replace") for p in pool.workers)
    finally:
        pool.stop()
    down = [float(ms) for a, b, ms in SWITCH.findall(logs) if int(b) < int(a)]
    up = [float(ms) for a, b, ms in SWITCH.findall(logs) if int(b) > int(a)]
    print(f"## Thread step-down ({Path(model).name}, 2 workers, --threads auto, "
          f"--pool-cores 2, {args.rounds} rounds)\n")
    print(harness.md_table(
        ["switch of a running job", "n", "p50 ms", "max ms"],
        [["step down (second job arrived)", len(down),
          percentile_50(down) if down else None, max(down, default=None)],
         ["step up (the other job ended)", len(up),
          percentile_50(up) if up else None, max(up, default=None)]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
