"""Slow clients hold no threads: read deadlines and the send timeout.

Through real gunicorn (``llamapool.http_worker``): a thousand connections
sending their request one byte a second, and more sending a slow body, do
not slow down real requests, and are closed after their deadline; clients
that never read a stream lose it after the send timeout, and the thread and
the slot come back.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.pool import Pool, wait_until
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

LONG = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "Hello", "max_tokens": 4}


def raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= wanted, \
        "the test needs more open files (ulimit -n)"


class SlowClients:
    """Connections that send their first bytes, then one byte a second."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, daemon=True)

    def open(self, n: int, first: bytes) -> None:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.sendall(first)
            s.setblocking(False)
            self.socks.append(s)

    def start(self) -> None:
        self._feeder.start()

    def _feed(self) -> None:
        while not self._stop.wait(1.0):
            for s in list(self.socks):
                try:
                    s.send(b"a")
                except OSError:
                    pass  # closed by the server; the check below sees it

    def wait_all_closed(self, timeout_s: float) -> dict[str, int]:
        """Wait until the server has closed every connection; how each ended."""
        ended = {"408": 0, "closed": 0, "other": 0}
        sel = selectors.DefaultSelector()
        for s in self.socks:
            sel.register(s, selectors.EVENT_READ, bytearray())
        deadline = time.monotonic() + timeout_s
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    key.data.extend(data)
                    continue
                got = bytes(key.data)
                kind = ("408" if got.startswith(b"HTTP/1.1 408")
                        else "closed" if not got else "other")
                ended[kind] += 1
                sel.unregister(key.fileobj)
        ended["still_open"] = len(sel.get_map())
        sel.close()
        return ended

    def close(self) -> None:
        self._stop.set()
        for s in self.socks:
            s.close()


def timed(fn, n: int = 5) -> float:
    """Median seconds of ``n`` calls; a failed or timed-out call counts as 60 s."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            ok = fn()
        except httpx.HTTPError:
            ok = False
        times.append(time.monotonic() - t0 if ok else 60.0)
    return statistics.median(times)


def legit_requests(url: str) -> dict[str, callable]:
    """Real clients' requests, each on a new connection."""
    return {
        "/health": lambda: httpx.get(url + "/health", timeout=10).status_code == 200,
        "/v1/models": lambda: httpx.get(url + "/v1/models",
                                        timeout=10).status_code == 200,
        "completion": lambda: httpx.post(url + "/v1/completions", json=SHORT,
                                         timeout=10).status_code == 200,
    }


deadline_pool = pool_fixture(workers=1,
                             frontend_env={"LLAMAPOOL_HEADER_TIMEOUT_S": "10",
                                           "LLAMAPOOL_BODY_TIMEOUT_S": "10"})


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
             b"application/json\r\nContent-Length: 5000\r\n\r\n{")


def test_slowloris_does_not_slow_real_requests(deadline_pool):
    """1,000 slow heads and 500 slow bodies: real requests stay within 2x of
    their latency without them, and the slow connections are closed after
    the 10 s deadline (408)."""
    pool = deadline_pool
    raise_fd_limit(4096)
    legit = legit_requests(pool.url)
    for fn in legit.values():
        fn()  # warm up
    baseline = {name: timed(fn) for name, fn in legit.items()}

    slow = SlowClients(pool.port)
    try:
        opened_at = time.monotonic()
        slow.open(1000, SLOW_HEAD)
        slow.open(500, SLOW_BODY)
        slow.start()
        under_attack = {name: timed(fn) for name, fn in legit.items()}
        measured_within_s = time.monotonic() - opened_at
        ended = slow.wait_all_closed(timeout_s=40)
    finally:
        slow.close()
    print(f"\nbaseline {baseline}\nunder attack {under_attack} "
          f"(measured within {measured_within_s:.1f} s of opening)\nended {ended}")
    for name, base in baseline.items():
        # 2x, with an absolute floor so a loaded machine cannot flake it.
        assert under_attack[name] <= max(2 * base, base + 1.0), (name, base,
                                                                under_attack)
    assert ended["still_open"] == 0, ended
    assert ended["other"] == 0, ended
    assert ended["408"] >= 1000, ended  # every one that was not evicted
    pool.assert_whole()


def test_arriving_requests_are_capped_per_process(tiny_model, tmp_path):
    """Past LLAMAPOOL_MAX_PENDING_CONNS the oldest arriving request is closed
    at once, not at its deadline: 300 slow heads leave 50 open."""
    raise_fd_limit(2048)
    pool = Pool(tiny_model, tmp_path, workers=1, frontend_env={
        "LLAMAPOOL_FRONTEND_PROCESSES": "1", "LLAMAPOOL_MAX_PENDING_CONNS": "50",
        "LLAMAPOOL_HEADER_TIMEOUT_S": "60"})
    slow = SlowClients(pool.port)
    try:
        slow.open(300, SLOW_HEAD)
        ended = slow.wait_all_closed(timeout_s=10)  # far less than 60 s
        assert ended["closed"] == 250 and ended["still_open"] == 50, ended
        assert httpx.get(pool.url + "/health", timeout=10).status_code == 200
        assert "(LLAMAPOOL_MAX_PENDING_CONNS): the oldest are closed" in \
            pool.frontend.log()
    finally:
        slow.close()
        pool.stop()


def test_clients_that_never_close_do_not_freeze_the_server(deadline_pool):
    """60 clients send a whole request with "Connection: close", read the
    answer, and never close their end. gthread used to wait up to 2 s for
    each one's FIN on its event loop; now real requests do not notice."""
    pool = deadline_pool
    legit = legit_requests(pool.url)["/health"]
    legit()
    baseline = timed(legit)
    lingerers = []
    try:
        for _ in range(60):
            s = socket.create_connection(("127.0.0.1", pool.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                      b"Connection: close\r\n\r\n")
            lingerers.append(s)
        under_load = timed(legit)
        for s in lingerers:  # every one was answered, and half-closed by us
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 OK")
    finally:
        for s in lingerers:
            s.close()
    print(f"\n/health p50 {baseline:.3f} s, with 60 lingering: {under_load:.3f} s")
    assert under_load <= max(2 * baseline, baseline + 1.0)


class NeverReads:
    """A streamed completion whose client reads nothing, with a tiny window."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps(LONG).encode()
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(payload), payload))


def test_clients_that_never_read_lose_the_stream_after_send_timeout(
        tiny_model, tmp_path):
    """As many never-reading streams as the frontend has threads: after the
    3 s send timeout their threads serve others again and their slots come
    back, long before the workers' 60 s stall timeout."""
    pool = Pool(tiny_model, tmp_path, workers=2, frontend_env={
        "LLAMAPOOL_FRONTEND_PROCESSES": "1", "LLAMAPOOL_FRONTEND_THREADS": "2",
        "LLAMAPOOL_SEND_TIMEOUT_S": "3"})
    stalled = []
    try:
        stalled = [NeverReads(pool.port) for _ in range(2)]
        wait_until(lambda: pool.status()["slots_free"] == 0, 30,
                   "both streams to take a slot")
        started = time.monotonic()
        pool.wait_free(2, timeout_s=30)
        freed_after_s = time.monotonic() - started
        r = httpx.get(pool.url + "/health", timeout=10)
        assert r.status_code == 200
        metrics = httpx.get(pool.url + "/metrics", timeout=10).text
        print(f"\nslots back {freed_after_s:.1f} s after both were taken")
        assert ('llamapool_lease_endings_total{ending="disconnect",'
                'model="tiny.gguf"} 2.0') in metrics
        assert "read nothing for 3 s; response ended" in pool.frontend.log()
        assert "Traceback" not in pool.frontend.log()
    finally:
        for s in stalled:
            s.sock.close()
        pool.stop()


def test_expect_continue_and_pipelined_requests_still_work(deadline_pool):
    """Reading in the event loop keeps HTTP/1.1's other ways of sending."""
    pool = deadline_pool
    body = json.dumps(SHORT).encode()
    with socket.create_connection(("127.0.0.1", pool.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        reply = b""
        while b'"finish_reason"' not in reply:
            reply += s.recv(65536)
        assert b" 200 OK" in reply
    with socket.create_connection(("127.0.0.1", pool.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n" * 2
                  + b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                    b"Connection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        assert reply.count(b"HTTP/1.1 200 OK") == 3
