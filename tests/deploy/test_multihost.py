"""Several hosts for real: network namespaces, veth links, one bridge, CURVE.

    broker  10.231.0.2    the broker (CURVE server, per-host keys authorized)
    wh1     10.231.0.11   two model workers
    wh2     10.231.0.12   two model workers
    fh1     10.231.0.21   a gunicorn frontend
    fh2     10.231.0.22   a gunicorn frontend
    client  10.231.0.100  this test's HTTP client and its ledger probe

Shown, with the numbers printed (run with ``-s``) and recorded as test
properties:

1. Requests go through both frontends and are served by workers on both
   worker hosts.
2. wh1's cable is pulled (its switch port set down) while it streams: the
   broker notices within its heartbeat window, the streams on wh1 end with an
   error event (no ``[DONE]``), and the stream on wh2 runs to its end.
3. wh2 keeps serving new requests while wh1 is gone.
4. The cable goes back: wh1's workers register again and serve again.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import time

import httpx
import pytest

from protocol import curve
from tests.deploy.helpers import CurveProbe, keygen
from tests.deploy.netns import Lan, NetnsExecutor, namespaces_work
from tests.pool import Proc, cli, wait_until
from tests.system_tools import unavailable

pytestmark = pytest.mark.stack

HEARTBEAT = ["--heartbeat-interval-s", "0.2", "--heartbeat-liveness", "3"]
DEAD_AFTER_S = 0.6  # 3 missed beats of 0.2 s
FRONTEND_PORT = 8080
# Long enough that the socket buffers and the credit window cannot hold the
# whole stream before a fault: 400 tokens could, and a stream the test meant
# to cut had already ended "done".
LONG = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}


class PausedStream:
    """A streamed completion over a bare socket whose reader pauses.

    With a tiny receive buffer and no reads, the frontend's writes block, it
    stops returning credit, and the worker pauses mid-stream: the stream
    stays open on its slot for as long as the test needs.
    """

    def __init__(self, address: str, body: dict) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect((address, FRONTEND_PORT))
        payload = json.dumps(body).encode()
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        self.data = b""
        while b"\r\n\r\n" not in self.data:
            self.data += self.sock.recv(4096)
        head = self.data.split(b"\r\n\r\n", 1)[0].decode()
        assert head.startswith("HTTP/1.1 200"), head
        headers = {key.lower(): value for key, value in
                   (line.split(": ", 1) for line in head.split("\r\n")[1:])}
        self.slot_id = int(headers["x-slot-id"])
        self.ended_at: float | None = None

    def drain(self) -> str:
        """Read to the end; return how it ended (``done``/``error:CODE``)."""
        while not self.data.endswith(b"0\r\n\r\n"):
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.data += chunk
            if self.ended_at is None and (b"data: {\"error\"" in self.data
                                          or b"data: [DONE]" in self.data):
                self.ended_at = time.monotonic()
        self.sock.close()
        if b"data: [DONE]" in self.data:
            return "done"
        start = self.data.index(b"data: {\"error\"") + len(b"data: ")
        event = json.loads(self.data[start:self.data.index(b"\n", start)])
        return f"error:{event['error'].get('code')}"


class Deployment:
    """The LAN and every process on it."""

    def __init__(self, run_dir, model) -> None:
        self.run_dir = run_dir
        self.procs: list[Proc] = []
        self.lan = Lan()
        self.client_pool: NetnsExecutor | None = None
        self.probe: CurveProbe | None = None
        self.streams: list[PausedStream] = []  # closed at teardown if still open
        try:
            self._start(model)
        except BaseException:
            self.close()
            raise

    def _start(self, model) -> None:
        lan, run = self.lan, self.run_dir
        hosts = {name: lan.add_host(name, octet) for name, octet in
                 [("broker", 2), ("wh1", 11), ("wh2", 12), ("fh1", 21),
                  ("fh2", 22), ("client", 100)]}
        keys = keygen(run / "keys", "--worker", "worker-wh1", "--worker",
                      "worker-wh2", "--frontend", "frontend-fh1", "--frontend",
                      "frontend-fh2", "--frontend", "probe")
        broker_ip = hosts["broker"].address
        self.frontends_ep = f"tcp://{broker_ip}:5555"
        workers_ep = f"tcp://{broker_ip}:5556"

        def client_keys(name: str) -> list[str]:
            return ["--curve-server-key", str(keys / "broker.key"),
                    "--curve-secret-key", str(keys / f"{name}.key_secret")]

        self._spawn("broker", hosts["broker"], cli(
            "broker", "--frontends", self.frontends_ep, "--workers", workers_ep,
            "--curve-secret-key", str(keys / "broker.key_secret"),
            "--curve-authorized-workers", str(keys / "authorized" / "workers"),
            "--curve-authorized-frontends", str(keys / "authorized" / "frontends"),
            *HEARTBEAT))
        self.worker_pids: dict[str, set[int]] = collections.defaultdict(set)
        for host in ("wh1", "wh2"):
            for i in (1, 2):
                proc = self._spawn(f"{host}-worker{i}", hosts[host], cli(
                    "worker", "--broker", workers_ep, "--model", str(model),
                    "--threads", "1", "--ctx", "2048",
                    *client_keys(f"worker-{host}"), *HEARTBEAT))
                self.worker_pids[host].add(proc.pid)
        env = dict(os.environ, LLAMAPOOL_FRONTEND_PROCESSES="1",
                   LLAMAPOOL_FRONTEND_THREADS="16", LLAMAPOOL_GRACEFUL_TIMEOUT_S="5")
        self.frontend_urls = {}
        for host in ("fh1", "fh2"):
            address = hosts[host].address
            self._spawn(f"{host}-frontend", hosts[host], cli(
                "frontend", "--broker", self.frontends_ep,
                "--bind", f"{address}:{FRONTEND_PORT}",
                *client_keys(f"frontend-{host}"), *HEARTBEAT), env=env)
            self.frontend_urls[host] = f"http://{address}:{FRONTEND_PORT}"
        self.hosts = hosts
        self.client_pool = NetnsExecutor(hosts["client"])
        probe_keys = curve.ClientKeys.from_files(keys / "broker.key",
                                                 keys / "probe.key_secret")
        self.probe = self.client_pool.call(CurveProbe, self.frontends_ep, probe_keys)
        self.wait_slots({"wh1": 2, "wh2": 2}, timeout_s=90)
        for url in self.frontend_urls.values():
            wait_until(lambda u=url: self.call(_healthy, u), 60, f"{url}/health")

    def _spawn(self, name, host, argv, env=None) -> Proc:
        proc = Proc(name, host.argv(argv), self.run_dir, env=env)
        self.procs.append(proc)
        return proc

    def call(self, fn, *args):
        """Run ``fn`` on the client host."""
        return self.client_pool.call(fn, *args)

    def status(self) -> dict:
        snap = self.call(self.probe.status, 2.0)
        assert snap is not None, "the broker did not answer the probe"
        return snap

    def slots_by_host(self) -> dict[str, int]:
        return dict(collections.Counter(s["host"] for s in self.status()["slots"]))

    def wait_slots(self, expected: dict[str, int], timeout_s: float) -> None:
        def reached():
            snap = self.call(self.probe.status, 1.0)
            if not snap or snap["slots_total"] != sum(expected.values()):
                return False
            return collections.Counter(s["host"] for s in snap["slots"]) == expected
        wait_until(reached, timeout_s, f"slots per host {expected}", interval_s=0.05)

    def host_of_slot(self, slot_id: int) -> str:
        (slot,) = [s for s in self.status()["slots"] if s["id"] == slot_id]
        return slot["host"]

    def served_by_host(self) -> dict[str, int]:
        served: dict[str, int] = collections.Counter()
        for s in self.status()["slots"]:
            served[s["host"]] += s["jobs_served"]
        return dict(served)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs)

    def close(self) -> None:
        errors = []
        for stream in self.streams:
            stream.sock.close()
        if self.probe is not None and self.client_pool is not None:
            self.client_pool.call(self.probe.close)
        if self.client_pool is not None:
            self.client_pool.shutdown()
        # Frontends first (no new requests), then workers, then the broker.
        for proc in reversed(self.procs):
            if proc.alive():
                try:
                    proc.stop()
                except AssertionError as exc:
                    errors.append(str(exc))
        self.lan.close()
        assert not errors, errors


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(url: str, prompt: str) -> tuple[int, int | None]:
    """One short completion; (HTTP status, slot id)."""
    resp = httpx.post(url + "/v1/completions", timeout=30,
                      json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True})
    slot = resp.headers.get("x-slot-id")
    return resp.status_code, int(slot) if slot else None


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    why_not = namespaces_work()
    if why_not:
        unavailable(why_not)
    dep = Deployment(tmp_path_factory.mktemp("multihost"), tiny_model)
    yield dep
    dep.close()


def test_multihost_serving_cut_and_recovery(deployment, record_property):
    dep = deployment
    numbers: dict = {}

    # 1. Both frontends, both worker hosts. Four at a time, so every slot is
    # used; a 503 (all four busy for a moment) is retried.
    # At least 24 requests; more rounds (up to 80) only if the broker has not
    # yet used both worker hosts.
    per_frontend: collections.Counter[str] = collections.Counter()
    served: dict[str, int] = {}
    sent = 0
    while sent < 24 or (len(served) < 2 and sent < 80):
        batch = [(h, dep.client_pool.submit(_retrying_complete, dep.frontend_urls[h],
                                            f"request {sent + i} says hi"))
                 for i, h in enumerate(("fh1", "fh2", "fh1", "fh2"))]
        for host, fut in batch:
            assert fut.result() == 200
            per_frontend[host] += 1
        sent += len(batch)
        served = {h: n for h, n in dep.served_by_host().items() if n}
    numbers["phase1_requests_per_frontend"] = dict(per_frontend)
    numbers["phase1_jobs_per_worker_host"] = served
    assert per_frontend["fh1"] == per_frontend["fh2"] == sent // 2
    assert set(served) == {"wh1", "wh2"}, served

    # 2. Streams on both worker hosts, paused by their readers.
    streams: dict[str, list[PausedStream]] = collections.defaultdict(list)
    for i in range(3):  # with 2 slots per host, 3 streams cover both hosts
        url_host = ("fh1", "fh2")[i % 2]
        stream = dep.call(PausedStream, dep.hosts[url_host].address, LONG)
        dep.streams.append(stream)
        streams[dep.host_of_slot(stream.slot_id)].append(stream)
        if streams["wh1"] and streams["wh2"]:
            break
    assert streams["wh1"] and streams["wh2"], dict(streams)
    _wait_paused(dep, [s.slot_id for ss in streams.values() for s in ss])

    cut_at = time.monotonic()
    dep.lan.cut("wh1")
    drains = {stream: dep.client_pool.submit(stream.drain)
              for ss in streams.values() for stream in ss}
    dep.wait_slots({"wh2": 2}, timeout_s=10)
    numbers["cut_to_broker_drop_s"] = round(time.monotonic() - cut_at, 3)
    endings = {stream: fut.result(timeout=60) for stream, fut in drains.items()}
    cut_errors = []
    for stream in streams["wh1"]:
        assert endings[stream] == "error:worker_died", endings[stream]
        cut_errors.append(round(stream.ended_at - cut_at, 3))
    for stream in streams["wh2"]:
        assert endings[stream] == "done"  # ran to max_tokens after the cut
    numbers["cut_to_error_event_s"] = cut_errors
    assert max(cut_errors) < DEAD_AFTER_S + 2.0

    # 3. wh2 keeps serving while wh1 is off the LAN.
    during = []
    for i in range(6):
        host = ("fh1", "fh2")[i % 2]
        status, slot = dep.call(_retrying_complete_slot, dep.frontend_urls[host],
                                f"while cut {i}")
        assert status == 200
        during.append(dep.host_of_slot(slot))
    numbers["during_cut_served_by"] = dict(collections.Counter(during))
    assert set(during) == {"wh2"}

    # 4. Cable back: wh1's workers (the same processes) register again.
    restored_at = time.monotonic()
    dep.lan.restore("wh1")
    dep.wait_slots({"wh1": 2, "wh2": 2}, timeout_s=30)
    numbers["restore_to_reregistered_s"] = round(time.monotonic() - restored_at, 3)
    pids = {s["pid"] for s in dep.status()["slots"] if s["host"] == "wh1"}
    assert pids == dep.worker_pids["wh1"]
    before = dep.served_by_host().get("wh1", 0)
    wait_until(lambda: _serve_four(dep) and dep.served_by_host()["wh1"] > before,
               30, "wh1 to serve again")
    numbers["after_restore_jobs_per_worker_host"] = dep.served_by_host()

    print("\nmulti-host numbers: " + json.dumps(numbers))
    for key, value in numbers.items():
        record_property(key, value)


def _retrying_complete(url: str, prompt: str) -> int:
    return _retrying_complete_slot(url, prompt)[0]


def _retrying_complete_slot(url: str, prompt: str) -> tuple[int, int | None]:
    """A completion, retried on 503 (admission control says: come back)."""
    deadline = time.monotonic() + 30
    while True:
        status, slot = _complete(url, prompt)
        if status != 503 or time.monotonic() > deadline:
            return status, slot
        time.sleep(0.05)  # a client's retry pause, not synchronisation


def _serve_four(dep: Deployment) -> bool:
    futures = [dep.client_pool.submit(_retrying_complete, dep.frontend_urls[h],
                                      f"after {i}")
               for i, h in enumerate(("fh1", "fh2", "fh1", "fh2"))]
    return all(f.result() == 200 for f in futures)


def _wait_paused(dep: Deployment, slot_ids: list[int]) -> None:
    """Wait until every slot's generation stops advancing (credit exhausted)."""
    seen: list[tuple] = []

    def paused():
        snap = dep.status()
        progress = tuple(
            (s["id"], s["state"], s["progress"].get("n_generated"))
            for s in snap["slots"] if s["id"] in slot_ids
        )
        seen.append(progress)
        busy = all(state == "busy" for _, state, _ in progress)
        return busy and len(seen) >= 4 and len(set(seen[-4:])) == 1

    wait_until(paused, 30, "the streams to pause", interval_s=0.25)
