"""Slow clients against the frontend: how many it takes to shut real requests out.

    make bench-slow-clients       # or: python -m tests.bench.bench_slow_clients

A real pool (broker, one tiny-model worker, gunicorn with the production
shape: 2 processes x 64 threads). Slow connections are added in steps, each
sending its request one byte a second (``head``: an endless header line;
``body``: a complete head, then the body). At each step eight real ``/health``
requests, each on a new connection with a 3 s timeout, are timed together.
The request deadlines are set to 600 s here so the connections stay for the
whole ramp: what is measured is whether they hold threads, not how soon they
are cut (that is ``tests/test_http_deadlines.py``).

Then ``never-read``: one frontend process with 4 threads, 4 workers, and 4
streamed completions whose clients never read (tiny receive window): how
long until a ``/health`` is answered again and the slots are free (the
workers' stall timeout is its default, 60 s; the send timeout its default,
30 s).

Run it with ``PYTHONPATH`` at another checkout to measure that code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.pool import Pool

HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
        b"application/json\r\nContent-Length: 100000\r\n\r\n{")
STEPS = [0, 32, 64, 96, 118, 126, 160, 256, 512, 1000, 2000]
LEGIT_REQUESTS = 8
LEGIT_TIMEOUT_S = 3.0


def health_once(url: str) -> float | None:
    """Seconds for one ``GET /health`` on a new connection (a raw socket, so
    the client's own cost does not drown the server's), or None on failure."""
    port = int(url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port),
                                      timeout=LEGIT_TIMEOUT_S) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                      b"Connection: close\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
    except OSError:
        return None
    if not reply.startswith(b"HTTP/1.1 200"):
        return None
    return time.monotonic() - t0


def legit_round(url: str) -> tuple[float | None, int]:
    """(median latency of the answered ones, how many timed out)."""
    with concurrent.futures.ThreadPoolExecutor(LEGIT_REQUESTS) as ex:
        results = list(ex.map(lambda _: health_once(url), range(LEGIT_REQUESTS)))
    answered = [r for r in results if r is not None]
    return (statistics.median(answered) if answered else None,
            len(results) - len(answered))


class Trickle:
    """Open connections that send one more byte every second."""

    def __init__(self, port: int, first: bytes) -> None:
        self.port, self.first = port, first
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._feed, daemon=True).start()

    def grow_to(self, n: int) -> None:
        while len(self.socks) < n:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.sendall(self.first)
            s.setblocking(False)
            self.socks.append(s)

    def _feed(self) -> None:
        while not self.stop.wait(1.0):
            for s in list(self.socks):
                try:
                    s.send(b"a")
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        for s in self.socks:
            s.close()


def ramp(model: Path, run_dir: Path, first: bytes, steps: list[int]) -> list[list]:
    pool = Pool(model, run_dir, workers=1, frontend_env={
        "LLAMAPOOL_FRONTEND_PROCESSES": "2", "LLAMAPOOL_FRONTEND_THREADS": "64",
        "LLAMAPOOL_HEADER_TIMEOUT_S": "600", "LLAMAPOOL_BODY_TIMEOUT_S": "600"})
    trickle = Trickle(pool.port, first)
    rows = []
    try:
        for n in steps:
            trickle.grow_to(n)
            time.sleep(1.5)  # let every connection reach the server's threads
            median_s, timed_out = legit_round(pool.url)
            rows.append([n, "-" if median_s is None else f"{median_s * 1000:.0f}",
                         f"{timed_out}/{LEGIT_REQUESTS}"])
            print(f"  {n} slow: /health p50 {rows[-1][1]} ms, timed out {rows[-1][2]}",
                  file=sys.stderr)
    finally:
        trickle.close()
        pool.stop()
    return rows


def never_read(model: Path, run_dir: Path, streams: int, limit_s: float) -> list:
    pool = Pool(model, run_dir, workers=streams, frontend_env={
        "LLAMAPOOL_FRONTEND_PROCESSES": "1",
        "LLAMAPOOL_FRONTEND_THREADS": str(streams)})
    payload = json.dumps({"prompt": "Hello", "max_tokens": 2000,
                          "ignore_eos": True, "stream": True}).encode()
    socks = []
    try:
        for _ in range(streams):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", pool.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(payload), payload))
            socks.append(s)
        t0 = time.monotonic()
        health_at = slots_at = None
        while time.monotonic() - t0 < limit_s and None in (health_at, slots_at):
            if health_at is None and health_once(pool.url) is not None:
                health_at = time.monotonic() - t0
            snap = pool.probe.status(timeout_s=1.0)
            if slots_at is None and snap and snap["slots_free"] == streams:
                slots_at = time.monotonic() - t0
            time.sleep(0.5)

        def shown(t):
            return f"{t:.0f}" if t is not None else f"> {limit_s:.0f} (never)"
        return [streams, shown(health_at), shown(slots_at)]
    finally:
        for s in socks:
            s.close()
        pool.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="steps up to 256, no never-read run")
    args = parser.parse_args(argv)
    steps = [n for n in STEPS if n <= 256] if args.quick else STEPS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    with tempfile.TemporaryDirectory(prefix="bench-slow-") as tmp:
        tmp = Path(tmp)
        model = tmp / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                        str(model)], check=True, capture_output=True)
        for name, first in (("heads", HEAD), ("bodies", BODY)):
            (tmp / name).mkdir()
            rows = ramp(model, tmp / name, first, steps)
            print(f"\n## Slow {name}, one byte a second (2 processes x 64 threads)\n")
            print("| slow connections | /health p50 ms | timed out (3 s) |")
            print("|---|---|---|")
            for row in rows:
                print("| " + " | ".join(str(c) for c in row) + " |")
        if not args.quick:
            (tmp / "never").mkdir()
            row = never_read(model, tmp / "never", 4, limit_s=90)
            print("\n## Clients that never read a stream (1 process x 4 threads)\n")
            print("| streams | /health answered again after, s "
                  "| slots free after, s |")
            print("|---|---|---|")
            print("| " + " | ".join(str(c) for c in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
