"""Retry-After while every slot is held by a slow reader, against the truth.

``python -m tests.bench.bench_retry_after`` starts a real pool (the tiny
model, 2 workers, a stall timeout of ``--stall-timeout-s``), holds both slots
with clients that stop reading, then asks every few seconds for a slot and
records the 503's Retry-After next to the time a slot really became free
(when the stall timeout ended the first paused job). A truthful hint is close
to "really free in"; the old one said 1 or 2 throughout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.harness import md_table
from tests.pool import Pool, wait_until
from tests.test_slot_paths import LONG, RawStream, wait_paused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stall-timeout-s", type=float, default=30.0)
    parser.add_argument("--every-s", type=float, default=5.0)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="retry-after-"))
    model = run_dir / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    str(model)], check=True, capture_output=True)
    pool = Pool(model, run_dir, workers=2,
                worker_args=("--stall-timeout-s", str(args.stall_timeout_s)))
    samples: list[tuple[float, str]] = []
    try:
        streams = [RawStream(pool.port, LONG) for _ in range(2)]
        for stream in streams:
            wait_paused(pool, int(stream.header("X-Slot-Id")))
        started = time.monotonic()
        while True:
            r = httpx.post(pool.url + "/v1/completions",
                           json={"prompt": "Hi", "max_tokens": 1}, timeout=10)
            now = time.monotonic() - started
            if r.status_code != 503:
                break
            samples.append((now, r.headers.get("Retry-After", "-")))
            time.sleep(args.every_s)  # the sampling period of this figure
        free_at = now
        wait_until(lambda: pool.status()["slots_free"] >= 1, 60, "a free slot")
        for stream in streams:
            stream.close()
    finally:
        pool.stop()
    rows = [[f"{t:.1f}", hint, f"<= {max(0.0, free_at - t):.1f}"]
            for t, hint in samples]
    print(f"both slots paused; a slot was free by {free_at:.1f} s "
          f"(stall timeout {args.stall_timeout_s:.0f} s)")
    print(md_table(["s since both paused", "Retry-After", "really free in, s"],
                   rows))


if __name__ == "__main__":
    main()
