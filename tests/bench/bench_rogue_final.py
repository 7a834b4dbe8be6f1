"""What a client gets when a rogue worker ends its job with an odd FINAL.

``python -m tests.bench.bench_rogue_final`` starts a real broker and a real
gunicorn frontend, plays the only worker by hand, and answers one request
(whole, then streamed) per case with a TOKEN and a FINAL whose usage or
timings hold odd values, in the shape the old protocol carried them (maps).
It prints, per case, what the client got: well-formed JSON (and its status)
or not, a cut stream, how long it waited, and whether the slot came back
(free, still busy, or the worker disconnected until it registers again).

Run it with ``PYTHONPATH`` on a checkout to measure that checkout (it only
uses what both the old and the new code have).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import tempfile
import time
from pathlib import Path

import httpx
import msgpack

from protocol import messages
from tests.bench.harness import md_table
from tests.test_terminal_frames import register, rogue_worker_pool, strict_json

H = messages.PROTOCOL_HEADER
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
TIMINGS = {"prompt_n": 2, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 3.0}

#: (name, usage, timings, finish_reason): odd values in the old map shape.
CASES = [
    ("a count as a string", {**USAGE, "completion_tokens": "2"}, TIMINGS, "stop"),
    ("a count as a list", {**USAGE, "prompt_tokens": [3]}, TIMINGS, "stop"),
    ("a negative count", {**USAGE, "completion_tokens": -2}, TIMINGS, "stop"),
    ("a NaN time", USAGE, {**TIMINGS, "prompt_ms": math.nan}, "stop"),
    ("an infinite time", USAGE, {**TIMINGS, "predicted_ms": math.inf}, "stop"),
    ("bytes in timings", USAGE, {**TIMINGS, "prompt_ms": b"\x00"}, "stop"),
    ("usage as a list", [3, 2, 5], TIMINGS, "stop"),
    ("finish reason as an int", USAGE, TIMINGS, 5),
]


def ask(port: int, stream: bool) -> tuple[int, str, float]:
    body = {"prompt": "Hi", "max_tokens": 5, "stream": stream}
    started = time.monotonic()
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json=body, timeout=60) as r:
            return r.status_code, r.read().decode(), time.monotonic() - started
    except httpx.HTTPError as exc:  # the server cut the response
        return 0, f"cut: {exc.__class__.__name__}", time.monotonic() - started


def verdict(status: int, text: str, stream: bool) -> str:
    """What a strict client makes of the answer."""
    if status == 0:
        return text
    try:
        if not stream:
            body = strict_json(text)
            return f"{status} " + (body["error"]["code"] if "error" in body
                                   else "answer")
        if not text.endswith("\n\n"):
            return f"{status}, stream cut"
        events = [e[len("data: "):] for e in text.split("\n\n") if e]
        parsed = [e if e == "[DONE]" else strict_json(e) for e in events]
    except ValueError as exc:
        return f"{status}, not JSON ({exc})"
    last = parsed[-1]
    if last == "[DONE]":
        return f"{status}, stream [DONE]"
    if isinstance(last, dict) and "error" in last:
        return f"{status}, error event {last['error']['code']}"
    return f"{status}, stream cut"


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="rogue-final-"))
    rows = []
    with rogue_worker_pool(run_dir) as (_broker, _frontend, port, probe, worker):
        register(worker, probe)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for name, usage, timings, reason in CASES:
                for stream in (False, True):
                    asked = pool.submit(ask, port, stream)
                    job_id = worker.expect(messages.Submit).job_id
                    worker.send(messages.Token(job_id, "Hello").to_wire())
                    body = [job_id, reason, usage, timings, ""]
                    worker.send([H, messages.Final.COMMAND, msgpack.packb(body)])
                    status, text, took_s = asked.result(timeout=120)
                    time.sleep(0.3)  # let the ledger settle before looking
                    snap = probe.status(2) or {}
                    if snap.get("slots_free") == 1:
                        slot = "free"
                    elif snap.get("slots_total") == 0:
                        slot = "worker disconnected"
                    else:
                        slot = "busy"
                    rows.append([name, "stream" if stream else "whole",
                                 verdict(status, text, stream), took_s, slot])
                    register(worker, probe)
    print(md_table(["FINAL from the worker", "request", "client got",
                    "answer after, s", "the slot after"], rows))


if __name__ == "__main__":
    main()
