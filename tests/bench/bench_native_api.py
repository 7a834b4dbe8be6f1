"""Before/after figures for llama.cpp's native endpoints (issue 11, section 2).

Starts a real pool (broker, 2 workers, gunicorn) on the tiny model and prints
one row per check: what a llama-server client gets. Run it on two checkouts
to compare::

    PYTHONPATH=. python -m tests.bench.bench_native_api
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.pool import Pool
from tests.test_slot_paths import hold_slot

TEXT = "Hello world, how are you? I am a test model. " * 8


def _ms(fn, n: int) -> tuple[list[int], float]:
    codes, times = [], []
    for _ in range(n):
        started = time.perf_counter()
        codes.append(fn().status_code)
        times.append((time.perf_counter() - started) * 1000)
    return codes, statistics.median(times)


def main() -> None:
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                        str(model)], check=True, capture_output=True)
        pool = Pool(model, Path(tmp), workers=2)
        url = pool.url
        try:
            def post(path: str, body: dict) -> httpx.Response:
                return httpx.post(url + path, json=body, timeout=60)

            # 1. Tokenizing while every slot is busy.
            held = [hold_slot(pool)[0] for _ in range(2)]
            before = pool.status()["counters"].get("submitted", 0)
            codes, p50 = _ms(lambda: post("/tokenize", {"content": TEXT}), 50)
            taken = pool.status()["counters"].get("submitted", 0) - before
            rows.append(("50 x /tokenize while both slots are busy",
                         f"{sorted(set(codes))}, median {p50:.1f} ms, "
                         f"{taken} jobs submitted"))
            # The same requests' floor on this machine, for scale.
            _, floor = _ms(lambda: httpx.get(url + "/health", timeout=60), 50)
            rows.append(("50 x GET /health at the same time (reference)",
                         f"median {floor:.1f} ms"))
            for stream in held:
                stream.close()
            pool.assert_whole()

            # 2. id_slot: does the job land on the slot asked for?
            ids = sorted(s["id"] for s in httpx.get(url + "/slots").json())
            landed, codes = 0, set()
            for _ in range(10):
                r = post("/completion", {"prompt": "Hi", "n_predict": 1,
                                         "id_slot": ids[1]})
                codes.add(r.status_code)
                landed += r.headers.get("X-Slot-Id") == str(ids[1])
            rows.append((f"10 x /completion with id_slot={ids[1]}",
                         f"{sorted(codes)}, {landed}/10 on that slot"))
            r = post("/completion", {"prompt": "Hi", "id_slot": 999})
            rows.append(("/completion with id_slot=999 (no such slot)",
                         f"{r.status_code} {r.text[:60]}"))

            # 3. cache_prompt false: prompt tokens reused on a repeat.
            for flag in (True, False):
                body = {"prompt": TEXT, "n_predict": 2, "cache_prompt": flag,
                        "id_slot": ids[0]}
                post("/completion", {**body, "cache_prompt": True})
                r = post("/completion", body)
                shown = (r.json()["timings"].get("cache_n") if r.status_code == 200
                         else r.text[:60])
                rows.append((f"repeat /completion, cache_prompt {flag}: cached "
                             "tokens", f"{r.status_code} {shown}"))

            # 4. The other native endpoints.
            for path, body in (("/detokenize", {"tokens": [361, 370]}),
                               ("/apply-template", {"messages": [
                                   {"role": "user", "content": "Hi"}]}),
                               ("/infill", {"input_prefix": "a",
                                            "input_suffix": "b"}),
                               ("/props", None)):
                r = (httpx.get(url + path) if body is None else post(path, body))
                rows.append((f"{'GET' if body is None else 'POST'} {path}",
                             f"{r.status_code} {r.text[:60]}"))
        finally:
            pool.stop()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}} | {value}")


if __name__ == "__main__":
    main()
