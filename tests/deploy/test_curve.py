"""ZeroMQ CURVE between hosts: keys, the bind policy, refusal, the happy path.

Real processes over loopback TCP. The broker accepts only the public keys in
its authorized directories, one per role; a peer with any other key never
completes the handshake, so it never gets a slot or a frame, and the refusal
is counted. Role tests (a frontend's key as a worker, a worker's key as a
frontend, a key overwritten in place) are in ``test_curve_roles.py``.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from llamapool.exit_codes import ExitCode
from protocol import curve, messages
from protocol.payloads import GenerationRequest
from tests.deploy.helpers import CurveProbe, keygen
from tests.pool import TEST_HEARTBEAT, Proc, cli, free_port, wait_until

pytestmark = pytest.mark.skipif(not curve.available(), reason="libzmq without CURVE")

MARKER = "zebra-marker-7731"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The deployment's keys, and a second set nobody authorized."""
    root = tmp_path_factory.mktemp("keys")
    return keygen(root / "pool"), keygen(root / "rogue")


def client_keys(keys_dir, name: str, broker_keys_dir=None) -> curve.ClientKeys:
    return curve.ClientKeys.from_files((broker_keys_dir or keys_dir) / "broker.key",
                                       keys_dir / f"{name}.key_secret")


def broker_argv(keys_dir, frontends: str, workers: str) -> list[str]:
    return cli("broker", "--frontends", frontends, "--workers", workers,
               "--curve-secret-key", str(keys_dir / "broker.key_secret"),
               *authorized_args(keys_dir), *TEST_HEARTBEAT)


def authorized_args(keys_dir) -> list[str]:
    """The broker's two allow-list flags for a ``llamapool keygen`` directory."""
    return ["--curve-authorized-workers", str(keys_dir / "authorized" / "workers"),
            "--curve-authorized-frontends",
            str(keys_dir / "authorized" / "frontends")]


def worker_argv(keys_dir, broker_keys_dir, workers: str, model) -> list[str]:
    return cli("worker", "--broker", workers, "--model", str(model),
               "--threads", "1",
               "--curve-server-key", str(broker_keys_dir / "broker.key"),
               "--curve-secret-key", str(keys_dir / "worker.key_secret"),
               *TEST_HEARTBEAT)


# --- keys and policy ----------------------------------------------------------


@pytest.mark.stack
def test_keygen_modes_and_idempotence(tmp_path):
    out = keygen(tmp_path / "k")
    for name in ("broker", "worker", "frontend"):
        assert stat.S_IMODE((out / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((out / f"{name}.key").stat().st_mode) == 0o644
    # One directory per role, never the broker's key.
    assert sorted(p.name for p in (out / "authorized").iterdir()) == [
        "frontends", "workers"]
    assert [p.name for p in (out / "authorized" / "workers").iterdir()] == [
        "worker.key"]
    assert [p.name for p in (out / "authorized" / "frontends").iterdir()] == [
        "frontend.key"]
    broker_secret = (out / "broker.key_secret").read_bytes()
    keygen(out, "--worker", "worker-host3")  # adds one pair, keeps the rest
    assert (out / "broker.key_secret").read_bytes() == broker_secret
    assert (out / "authorized" / "workers" / "worker-host3.key").exists()
    assert not (out / "authorized" / "frontends" / "worker-host3.key").exists()
    for bad_args, why in [(["--worker", "../escape"], "bad key name"),
                          (["--frontend", "worker-host3"], "one role"),
                          (["--worker", "x", "--frontend", "x"], "one role"),
                          (["--client", "h1"], "--worker NAME or --frontend")]:
        bad = subprocess.run([sys.executable, "-m", "llamapool", "keygen", str(out),
                              *bad_args], capture_output=True, text=True)
        assert bad.returncode == 2 and why in bad.stdout, (bad_args, bad.stdout)
    assert not (out / "x.key_secret").exists()  # a refusal writes nothing


@pytest.mark.parametrize("endpoint, local", [
    ("ipc:///run/llamapool/w", True), ("inproc://x", True),
    ("tcp://127.0.0.1:5555", True), ("tcp://127.1.2.3:5555", True),
    ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.0.0.5:5555", False), ("tcp://eth0:5555", False),
    ("tcp://[::]:5555", False), ("tcp://broker.example:5555", False),
])
def test_local_endpoints(endpoint, local):
    assert curve.is_local_endpoint(endpoint) is local


@pytest.mark.stack  # its ``keys`` are written by the real ``llamapool keygen``
def test_watching_a_new_connection_never_collides_with_an_old_monitor(keys):
    """A redial's new DEALER may reuse the file descriptor of the one it
    replaces while that one's handshake monitor is still bound: pyzmq's
    default monitor address (``inproc://monitor.s-FD``) was then in use, and
    the exception ended a worker's link thread (seen in a CI run of
    test_overwritten_key_is_noticed). Simulated here by holding that address."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    squatter = ctx.socket(zmq.PAIR)
    try:
        squatter.bind(f"inproc://monitor.s-{sock.FD}")
        pool_keys, _rogue = keys
        # Raised "ZMQError: Address already in use" before the fix.
        client_keys(pool_keys, "worker").apply(sock)
    finally:
        sock.close(linger=0)
        squatter.close(linger=0)
        ctx.term()


@pytest.mark.stack
def test_plaintext_on_a_network_address_is_refused(tmp_path, keys):
    exposed = f"tcp://0.0.0.0:{free_port()}"
    refused = subprocess.run(
        cli("broker", "--frontends", exposed, "--workers", f"ipc://{tmp_path}/w"),
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == ExitCode.INSECURE
    assert "without CURVE" in refused.stderr
    bad_key = subprocess.run(
        cli("broker", "--frontends", exposed, "--workers", f"ipc://{tmp_path}/w",
            "--curve-secret-key", str(tmp_path / "missing.key_secret"),
            *authorized_args(keys[0])),
        capture_output=True, text=True, timeout=60,
    )
    assert bad_key.returncode == ExitCode.CURVE_KEYS
    # The explicit opt-out binds, and says so.
    broker = Proc("broker", cli("broker", "--frontends", exposed, "--workers",
                                f"ipc://{tmp_path}/w2", "--insecure-plaintext"),
                  tmp_path)
    try:
        wait_until(lambda: "broker listening" in broker.log(), 30, "the broker")
        assert "INSECURE" in broker.log()
    finally:
        assert broker.stop() == 0


# --- refusal --------------------------------------------------------------------


def _wait_auth_failed(monitor: zmq.Socket, timeout_s: float) -> None:
    """Wait for the handshake to be refused (the client side's own view)."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while (remaining := deadline - time.monotonic()) > 0:
        if not monitor.poll(remaining * 1000):
            break
        event = recv_monitor_message(monitor)["event"]
        seen.append(event)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "an unlisted key got in"
    raise AssertionError(f"no handshake failure seen; events: {seen}")


def try_send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Queue frames if the socket still has a pipe.

    libzmq drops a connection whose handshake failed and does not reconnect,
    so a blocking send on it would wait forever.
    """
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


@pytest.mark.stack
def test_unlisted_key_is_refused_and_counted(tmp_path, keys, tiny_model):
    pool_keys, rogue_keys = keys
    frontends = f"tcp://127.0.0.1:{free_port()}"
    workers = f"tcp://127.0.0.1:{free_port()}"
    metrics_port = free_port()
    broker = Proc("broker", [*broker_argv(pool_keys, frontends, workers),
                             "--metrics-port", str(metrics_port)], tmp_path)
    worker = Proc("worker", worker_argv(pool_keys, pool_keys, workers, tiny_model),
                  tmp_path)
    # A worker with a well-formed key pair that is not in authorized/.
    rogue_worker = Proc("rogue-worker",
                        worker_argv(rogue_keys, pool_keys, workers, tiny_model),
                        tmp_path)
    ctx = zmq.Context()
    probe = CurveProbe(frontends, client_keys(pool_keys, "frontend"), ctx)
    rogue = ctx.socket(zmq.DEALER)
    plain = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        def one_slot():
            snap = probe.status(timeout_s=1)
            return snap if snap and snap["slots_total"] == 1 else None

        wait_until(one_slot, 60, "the authorized worker to register")
        # Its handshake is refused at connect (libzmq then drops that
        # connection for good); it loads its model all the same.
        wait_until(lambda: "model loaded" in rogue_worker.log(), 60,
                   "the rogue worker to load")
        # A rogue frontend: it knows the broker's public key, not a listed key.
        # (Our own monitor below, so no watcher thread on this socket.)
        client_keys(rogue_keys, "frontend", pool_keys).apply(rogue, watch=False)
        rogue.setsockopt(zmq.LINGER, 0)
        monitor = rogue.get_monitor_socket()
        monitor.setsockopt(zmq.LINGER, 0)
        rogue.connect(frontends)
        submit = messages.Submit(
            "rogue-job", GenerationRequest("completion", "hi", max_tokens=4))
        try_send(rogue, messages.Hello(os.getpid(), "rogue").to_wire())
        try_send(rogue, submit.to_wire())
        _wait_auth_failed(monitor, timeout_s=10)
        # And a peer without CURVE at all.
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(frontends)
        try_send(plain, submit.to_wire())

        def refusals():
            snap = probe.status(timeout_s=1)
            return snap if snap and snap["counters"]["curve_refused"] >= 2 else None

        snap = wait_until(refusals, 30, "both unlisted keys to be refused")
        # Three heartbeat windows later, still nothing reached either side.
        assert not rogue.poll(600) and not plain.poll(1)
        snap = probe.status()
        assert snap["slots_total"] == 1
        assert [s["pid"] for s in snap["slots"]] == [worker.pid]
        assert snap["counters"].get("submitted", 0) == 0
        # Only the probe itself (it registers, as STATUS needs): the rogue
        # HELLO never arrived.
        assert snap["frontends"] == 1
        assert "worker registered" not in rogue_worker.log()
        # The refused worker says why, instead of waiting in silence. Each
        # socket it makes lives one silence window (0.6 s here) before it
        # reconnects; on a loaded machine the ZAP refusal can take longer than
        # that, so several attempts may pass before one logs. Wait on the line,
        # with a deadline that only a broken watcher reaches.
        wait_until(lambda: "refused this peer's CURVE public key"
                   in rogue_worker.log(), 90, "the rogue worker's error line")
        # And it keeps redialling: its link never blocks on the connection
        # libzmq dropped, so authorising its key later needs no restart.
        wait_until(lambda: rogue_worker.log().count(
            "refused this peer's CURVE public key") >= 2, 90,
            "the rogue worker to redial and be refused again")
        print(f"\ncurve_refused={snap['counters']['curve_refused']}")

        def exported():
            # At least the two refusals above: the rogue worker reconnects
            # after each silence window and is refused (and counted) again.
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = httpx.get(url, timeout=2).text
            found = re.search(r"^llamapool_broker_curve_refused_total (\S+)$",
                              text, re.MULTILINE)
            return found is not None and float(found.group(1)) >= 2

        wait_until(exported, 60, "curve_refused in the broker's /metrics")
    finally:
        if monitor is not None:
            rogue.disable_monitor()
            monitor.close(0)
        for sock in (rogue, plain):
            sock.close(0)
        probe.close()
        ctx.term()
        codes = [rogue_worker.stop(), worker.stop(), broker.stop()]
    assert codes == [0, 0, 0]
    assert "refused public key" in broker.log()


# --- the encrypted happy path -----------------------------------------------------


class RecordingRelay:
    """A TCP relay that keeps every byte it forwards (what a sniffer would see)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.captured = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.captured += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.stack
def test_encrypted_pool_serves_openai_requests(tmp_path, keys, tiny_model):
    pool_keys, _ = keys
    f_port, w_port, http_port = free_port(), free_port(), free_port()
    frontends, workers = f"tcp://127.0.0.1:{f_port}", f"tcp://127.0.0.1:{w_port}"
    relay = RecordingRelay(f_port)  # the frontend reaches the broker through it
    broker = Proc("broker", broker_argv(pool_keys, frontends, workers), tmp_path)
    worker = Proc("worker", worker_argv(pool_keys, pool_keys, workers, tiny_model),
                  tmp_path)
    env = dict(os.environ, LLAMAPOOL_FRONTEND_PROCESSES="1")
    frontend = Proc("frontend", cli(
        "frontend", "--broker", f"tcp://127.0.0.1:{relay.port}",
        "--bind", f"127.0.0.1:{http_port}",
        "--curve-server-key", str(pool_keys / "broker.key"),
        "--curve-secret-key", str(pool_keys / "frontend.key_secret"),
        *TEST_HEARTBEAT), tmp_path, env=env)
    probe = CurveProbe(frontends, client_keys(pool_keys, "frontend"))
    try:
        def healthy():
            import urllib.request
            try:
                url = f"http://127.0.0.1:{http_port}/health"
                with urllib.request.urlopen(url, timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, 60, "the encrypted pool to be healthy")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt=f"{MARKER} hello",
                                        max_tokens=8, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": MARKER}],
            max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        snap = probe.status()
        assert snap["counters"]["curve_refused"] == 0
        assert snap["counters"]["submitted"] == 2
        # The prompt crossed the relay, but only as ciphertext.
        assert len(relay.captured) > 1000
        assert MARKER.encode() not in relay.captured
        assert b"prompt" not in relay.captured
    finally:
        probe.close()
        codes = [frontend.stop(), worker.stop(), broker.stop()]
        relay.close()
    assert codes == [0, 0, 0]
