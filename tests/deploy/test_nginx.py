"""Real nginx, with the shipped config, in front of two real frontends.

Two gunicorn frontends on different ports share one broker; nginx runs in the
foreground from a temporary prefix whose config ``include``s
``deploy/nginx/llamapool.conf`` (its upstream servers and listen address
rewritten for loopback). Checked: requests are spread over both frontends
(nginx's access log names the upstream, and that frontend's own request log
has the request id), and a streamed completion reaches the client event by
event, not in one burst when the stream ends.

The worker is the synthetic engine at a fixed token rate, so a stream has a
known, human-scale duration.
"""

from __future__ import annotations

import collections
import os
import re
import select
import socket
import statistics
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until
from tests.system_tools import require_tool

pytestmark = pytest.mark.stack

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHIPPED_CONF = DEPLOY / "nginx" / "llamapool.conf"
TOKENS_PER_SECOND = 25


def render_conf(frontend_ports: list[int], listen_port: int) -> str:
    """The shipped config, pointed at loopback frontends."""
    text = SHIPPED_CONF.read_text()
    servers = re.findall(r"^([ \t]*server[ \t]+)(\S+:\d+)([ \t].*;)$", text,
                         flags=re.M)
    assert len(servers) == len(frontend_ports), "upstream servers in the shipped conf"
    for (indent, address, options), port in zip(servers, frontend_ports, strict=True):
        text = text.replace(f"{indent}{address}{options}",
                            f"{indent}127.0.0.1:{port}{options}", 1)
    text, n = re.subn(r"^([ \t]*)listen[ \t]+80;$",
                      rf"\1listen 127.0.0.1:{listen_port};",
                      text, flags=re.M)
    assert n == 1, "one listen directive in the shipped conf"
    return text


def nginx_conf(prefix: Path, included: Path) -> str:
    return f"""
daemon off;
user root;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    log_format upstreams '$llamapool_request_id $upstream_addr $status';
    access_log {prefix}/access.log upstreams;
    include {included};
}}
"""


class Balanced:
    """broker + synthetic worker + two frontends + nginx, all real processes."""

    def __init__(self, run: Path, nginx: str) -> None:
        self.run = run
        self.procs: list[Proc] = []
        self.probe: BrokerProbe | None = None
        try:
            self._start(nginx)
        except BaseException:
            self.stop(check=False)
            raise

    def _start(self, nginx: str) -> None:
        run = self.run
        frontends, workers = f"ipc://{run}/frontends", f"ipc://{run}/workers"
        self.procs += [
            Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                               workers, *TEST_HEARTBEAT), run),
            Proc("worker", cli("worker", "--broker", workers, "--engine",
                               "synthetic", "--tokens-per-second",
                               str(TOKENS_PER_SECOND), *TEST_HEARTBEAT), run),
        ]
        self.probe = BrokerProbe(frontends)
        env = dict(os.environ, LLAMAPOOL_FRONTEND_PROCESSES="1")
        self.frontends: dict[int, Proc] = {}
        for i in (1, 2):
            port = free_port()
            self.frontends[port] = Proc(
                f"frontend{i}", cli("frontend", "--broker", frontends, "--bind",
                                    f"127.0.0.1:{port}", *TEST_HEARTBEAT),
                run, env=env)
        self.procs += list(self.frontends.values())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        included = run / "llamapool.conf"
        included.write_text(render_conf(list(self.frontends), self.port))
        conf = run / "nginx.conf"
        conf.write_text(nginx_conf(run, included))
        self.access_log = run / "access.log"
        self.procs.append(Proc("nginx", [nginx, "-p", str(run), "-c", str(conf),
                                         "-e", str(run / "error.log")], run))
        for port in self.frontends:
            wait_until(lambda p=port: self._ok(f"http://127.0.0.1:{p}/health"), 60,
                       f"frontend on {port}")
        wait_until(lambda: self._ok(self.url + "/health"), 30, "nginx")

    @staticmethod
    def _ok(url: str) -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def upstream_of(self) -> dict[str, int]:
        """request id -> frontend port, from nginx's access log."""
        served = {}
        for line in self.access_log.read_text().splitlines():
            rid, upstream, _status = line.split()
            served[rid] = int(upstream.rsplit(":", 1)[1])
        return served

    def stop(self, check: bool = True) -> None:
        if self.probe is not None:
            self.probe.close()
        errors = []
        for proc in reversed(self.procs):  # nginx, frontends, worker, broker
            try:
                proc.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        assert not (check and errors), errors


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    nginx = require_tool("nginx")
    stack = Balanced(tmp_path_factory.mktemp("nginx"), nginx)
    yield stack
    stack.stop()


def test_requests_spread_over_both_frontends(balanced):
    ids = [f"lb-{i}-{uuid.uuid4().hex[:8]}" for i in range(8)]
    for rid in ids:
        resp = httpx.post(balanced.url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2},
                          headers={"X-Request-Id": rid}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == rid  # one id end to end

    def all_logged():
        served = balanced.upstream_of()
        return served if set(ids) <= set(served) else None

    served = wait_until(all_logged, 10, "nginx's access log")
    per_frontend = collections.Counter(served[rid] for rid in ids)
    print(f"\nrequests per frontend port through nginx: {dict(per_frontend)}")
    assert set(per_frontend) == set(balanced.frontends)
    assert min(per_frontend.values()) >= 2
    # Each frontend logged exactly the requests nginx says it served.
    for port, proc in balanced.frontends.items():
        mine = {rid for rid in ids if served[rid] == port}
        wait_until(lambda p=proc, m=mine: all(r in p.log() for r in m), 10,
                   f"frontend {port}'s request log")
        assert not any(rid in proc.log() for rid in set(ids) - mine)


def test_stream_arrives_event_by_event(balanced):
    n_tokens = 25  # about one second at TOKENS_PER_SECOND
    started = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    with httpx.stream("POST", balanced.url + "/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": n_tokens,
                            "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - started, line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    times = [t for t, data in arrivals if '"text": "' in data or '"text":"' in data]
    assert len(times) >= n_tokens
    span = times[-1] - times[0]
    median_gap = statistics.median(b - a for a, b in zip(times, times[1:],
                                                          strict=False))
    print(f"\nSSE through nginx: {len(times)} events, first at {times[0]:.3f}s, "
          f"last at {times[-1]:.3f}s, median gap {median_gap * 1000:.0f} ms "
          f"(generation rate {1000 / TOKENS_PER_SECOND:.0f} ms/token)")
    # Buffered, every event would land in one burst when the stream ended.
    expected_s = (n_tokens - 1) / TOKENS_PER_SECOND
    assert span > 0.6 * expected_s
    assert times[0] < times[-1] / 2
    assert median_gap > 0.5 / TOKENS_PER_SECOND


# --- nginx absorbs slow and greedy clients (issue 10, the deployment part) ---

PER_ADDRESS_LIMIT = 64  # limit_conn in the shipped config
HEADER_TIMEOUT_S = 10  # client_header_timeout in the shipped config


def _open(balanced, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", balanced.port), timeout=60)
    sock.sendall(head)
    return sock


def _status_of_health(balanced) -> int:
    return httpx.get(balanced.url + "/health", timeout=30).status_code


def test_slow_request_heads_are_cut_by_nginx(balanced):
    """Slowloris at the balancer: 100 heads that grow by one byte a second are
    closed at the header deadline, and a legitimate request meanwhile is
    served."""
    started = time.monotonic()
    open_socks = {_open(balanced, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-a: ")
                  for _ in range(100)}
    closed_at: list[float] = []
    try:
        assert _status_of_health(balanced) == 200
        deadline = started + HEADER_TIMEOUT_S + 20
        while open_socks and time.monotonic() < deadline:
            for sock in list(open_socks):
                try:
                    sock.send(b"a")  # one more header byte per second
                    readable, _, _ = select.select([sock], [], [], 0)
                    cut = bool(readable) and (not (reply := sock.recv(4096))
                                              or b" 408 " in reply)
                except OSError:  # reset or broken pipe: cut as well
                    cut = True
                if cut:
                    closed_at.append(time.monotonic() - started)
                    open_socks.discard(sock)
                    sock.close()
            if open_socks:
                select.select(list(open_socks), [], [], 1.0)
        assert not open_socks, (f"{len(open_socks)} slow heads still open "
                                f"{time.monotonic() - started:.0f} s on")
        print(f"\n100 slow heads cut after {min(closed_at):.1f}-"
              f"{max(closed_at):.1f} s (client_header_timeout "
              f"{HEADER_TIMEOUT_S} s)")
        assert min(closed_at) >= HEADER_TIMEOUT_S - 1
    finally:
        for sock in open_socks:
            sock.close()


def test_connections_per_address_are_limited(balanced):
    """One address cannot hold more than the limit of requests open at once:
    the next gets nginx's 429, and none of it reaches a frontend thread
    (bodies are buffered by nginx)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    held = [_open(balanced, head) for _ in range(PER_ADDRESS_LIMIT)]
    try:
        # nginx counts a connection once its head is read; poll until all are.
        wait_until(lambda: _status_of_health(balanced) == 429, 30,
                   "a 429 beyond the per-address limit")
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _status_of_health(balanced) == 200, 30,
               "/health served again once the held connections closed")
