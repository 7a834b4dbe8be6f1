"""CURVE keys have roles: real broker, real workers, real gunicorn, loopback TCP.

The broker checks a client's public key against the directory of the socket's
role: ``authorized/workers`` on the workers socket, ``authorized/frontends``
on the frontends socket. These tests run the attacks the roles exist to stop
(a frontend's key registering as a worker, a worker's key submitting jobs),
overwrite a key in place, and check how ``llamapool keygen`` treats
directories. ``tests/bench/curve_roles_attacks.py`` runs the same attacks
against any checkout and prints the before/after table.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from llamapool.exit_codes import ExitCode
from protocol import curve, messages
from protocol.payloads import GenerationRequest
from tests.deploy.helpers import CurveProbe, keygen
from tests.pool import TEST_HEARTBEAT, Proc, cli, free_port, wait_until

pytestmark = pytest.mark.skipif(not curve.available(), reason="libzmq without CURVE")


def client_keys(keys_dir, name: str) -> curve.ClientKeys:
    return curve.ClientKeys.from_files(keys_dir / "broker.key",
                                       keys_dir / f"{name}.key_secret")


def broker_argv(keys_dir, frontends: str, workers: str) -> list[str]:
    return cli("broker", "--frontends", frontends, "--workers", workers,
               "--curve-secret-key", str(keys_dir / "broker.key_secret"),
               "--curve-authorized-workers", str(keys_dir / "authorized" / "workers"),
               "--curve-authorized-frontends",
               str(keys_dir / "authorized" / "frontends"), *TEST_HEARTBEAT)


def worker_argv(keys_dir, key_name: str, workers: str, model) -> list[str]:
    return cli("worker", "--broker", workers, "--model", str(model),
               "--threads", "1",
               "--curve-server-key", str(keys_dir / "broker.key"),
               "--curve-secret-key", str(keys_dir / f"{key_name}.key_secret"),
               *TEST_HEARTBEAT)


def frontend_proc(keys_dir, key_name: str, frontends: str, http_port: int,
                  run_dir) -> Proc:
    env = dict(os.environ, LLAMAPOOL_FRONTEND_PROCESSES="1")
    return Proc(f"frontend-{key_name}", cli(
        "frontend", "--broker", frontends, "--bind", f"127.0.0.1:{http_port}",
        "--curve-server-key", str(keys_dir / "broker.key"),
        "--curve-secret-key", str(keys_dir / f"{key_name}.key_secret"),
        *TEST_HEARTBEAT), run_dir, env=env)


def _slot_pids(probe) -> list[int]:
    snap = probe.status(timeout_s=1)
    return [s["pid"] for s in snap["slots"]] if snap else []


def handshake(endpoint: str, keys: curve.ClientKeys, timeout_s: float = 30) -> str:
    """Connect a fresh CURVE DEALER; "accepted" or "refused" as the client sees it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.apply(sock, watch=False)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not monitor.poll(remaining * 1000):
                break
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "accepted"
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "refused"
        raise AssertionError(f"no handshake outcome within {timeout_s}s")
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


@pytest.fixture(scope="module")
def role_keys(tmp_path_factory):
    """A deployment's keys: one worker pair, one frontend pair."""
    return keygen(tmp_path_factory.mktemp("roles") / "keys")


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _healthy(port: int) -> bool:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


# --- a frontend's key on the workers socket -----------------------------------------


@pytest.mark.stack
def test_frontend_key_cannot_register_as_worker(tmp_path, role_keys, endpoints,
                                                tiny_model, record_property):
    """A real worker holding the frontend's key pair never gets a slot or a job."""
    frontends, workers = endpoints
    http_port = free_port()
    broker = Proc("broker", broker_argv(role_keys, frontends, workers), tmp_path)
    worker = Proc("worker", worker_argv(role_keys, "worker", workers, tiny_model),
                  tmp_path)
    impostor = Proc("impostor", worker_argv(role_keys, "frontend", workers,
                                            tiny_model), tmp_path)
    frontend = frontend_proc(role_keys, "frontend", frontends, http_port, tmp_path)
    probe = CurveProbe(frontends, client_keys(role_keys, "frontend"))
    try:
        wait_until(lambda: _healthy(http_port), 90, "the pool to be healthy")

        def impostor_decided():
            # Refused (counted per role), or (the bug) registered as a slot.
            snap = probe.status(timeout_s=1)
            if snap is None:
                return None
            refused = snap["counters"].get("curve_refused_workers", 0)
            return snap if refused >= 1 or snap["slots_total"] >= 2 else None

        wait_until(lambda: "model loaded" in impostor.log(), 90, "the impostor")
        snap = wait_until(impostor_decided, 60, "the impostor's handshake")
        record_property("impostor_slots", snap["slots_total"] - 1)
        assert [s["pid"] for s in snap["slots"]] == [worker.pid], \
            "a frontend's key registered as a worker"
        # Jobs go to the real worker only; the impostor never sees a frame.
        for i in range(4):
            r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                           json={"prompt": f"secret prompt {i}", "max_tokens": 4},
                           timeout=60)
            assert r.status_code == 200, r.text
        snap = probe.status()
        assert snap["counters"]["submitted"] == 4
        assert snap["counters"]["finished"] == 4
        assert [s["pid"] for s in snap["slots"]] == [worker.pid]
        assert snap["counters"]["curve_refused_workers"] >= 1
        assert snap["counters"]["curve_refused_frontends"] == 0
        assert "worker registered" not in impostor.log()
        wait_until(lambda: "refused this peer's CURVE public key" in impostor.log(),
                   90, "the impostor's own error line")
        assert "--curve-authorized-workers" in impostor.log()
        record_property("curve_refused_workers",
                        snap["counters"]["curve_refused_workers"])
    finally:
        probe.close()
        codes = [frontend.stop(), impostor.stop(), worker.stop(), broker.stop()]
    assert codes == [0, 0, 0, 0]
    assert "on the workers socket" in broker.log()


# --- a worker's key on the frontends socket -----------------------------------------


@pytest.mark.stack
def test_worker_key_cannot_submit(tmp_path, role_keys, endpoints, tiny_model,
                                  record_property):
    """A real gunicorn frontend, and a raw SUBMIT, holding the worker's key pair."""
    frontends, workers = endpoints
    http_port = free_port()
    broker = Proc("broker", broker_argv(role_keys, frontends, workers), tmp_path)
    worker = Proc("worker", worker_argv(role_keys, "worker", workers, tiny_model),
                  tmp_path)
    impostor = frontend_proc(role_keys, "worker", frontends, http_port, tmp_path)
    probe = CurveProbe(frontends, client_keys(role_keys, "frontend"))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    try:
        def one_slot():
            snap = probe.status(timeout_s=1)
            return snap if snap and snap["slots_total"] == 1 else None

        wait_until(one_slot, 90, "the worker to register")
        # A raw client: HELLO and SUBMIT with the worker's key.
        assert handshake(frontends, client_keys(role_keys, "worker")) == "refused"
        raw.setsockopt(zmq.LINGER, 0)
        client_keys(role_keys, "worker").apply(raw, watch=False)
        raw.connect(frontends)
        for msg in (messages.Hello(os.getpid(), "impostor"),
                    messages.Submit("stolen-key-job",
                                    GenerationRequest("completion", "hi",
                                                      max_tokens=4))):
            try:
                raw.send_multipart(msg.to_wire(), zmq.NOBLOCK)
            except zmq.Again:
                pass  # libzmq dropped the refused connection: nothing to queue on
        # The gunicorn frontend: up, but the broker never hears from it.
        wait_until(lambda: "refused this peer's CURVE public key" in impostor.log(),
                   90, "the impostor frontend's error line")
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                       json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        record_property("impostor_http_status", r.status_code)
        assert r.status_code != 200, "a worker's key submitted a job"
        assert not raw.poll(100)
        snap = probe.status()
        assert snap["counters"].get("submitted", 0) == 0
        assert snap["frontends"] == 1  # the probe; neither impostor HELLO arrived
        assert snap["counters"]["curve_refused_frontends"] >= 2
        assert snap["counters"]["curve_refused_workers"] == 0
        assert [s["pid"] for s in snap["slots"]] == [worker.pid]
        record_property("curve_refused_frontends",
                        snap["counters"]["curve_refused_frontends"])
    finally:
        raw.close(0)
        probe.close()
        codes = [impostor.stop(), worker.stop(), broker.stop()]
    assert codes == [0, 0, 0]


# --- a key overwritten in place -------------------------------------------------------


def overwrite_in_place(path, content: bytes) -> None:
    """Rewrite ``path``'s bytes keeping its inode, size and times (``cp -p`` over it).

    The directory's mtime does not move, nor the file's size (z85 keys all
    have one length) or mtime; only its ctime does.
    """
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(content)
        f.truncate()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.stack
def test_overwritten_key_is_noticed(tmp_path, endpoints, record_property):
    """Old key refused (even on its open link), new key accepted, no restart."""
    keys = keygen(tmp_path / "keys", "--worker", "w-old", "--frontend", "frontend",
                  "--frontend", "f-revoked")
    spare = keygen(tmp_path / "spare", "--worker", "w-new")
    (tmp_path / "keys" / "w-new.key_secret").write_bytes(
        (spare / "w-new.key_secret").read_bytes())
    frontends, workers = endpoints
    metrics_port = free_port()
    broker = Proc("broker", [*broker_argv(keys, frontends, workers),
                             "--metrics-port", str(metrics_port)], tmp_path)
    probe = CurveProbe(frontends, client_keys(keys, "frontend"))
    synthetic = ("--engine", "synthetic", "--tokens-per-second", "200")
    worker_args = lambda key: cli(  # noqa: E731
        "worker", "--broker", workers, *synthetic,
        "--curve-server-key", str(keys / "broker.key"),
        "--curve-secret-key", str(keys / f"{key}.key_secret"), *TEST_HEARTBEAT)
    old_worker = Proc("worker-old", worker_args("w-old"), tmp_path)
    new_worker = None
    try:
        wait_until(lambda: (probe.status(timeout_s=1) or {}).get("slots_total") == 1,
                   60, "the w-old worker to register")
        assert handshake(workers, client_keys(keys, "w-old")) == "accepted"
        assert handshake(workers, client_keys(keys, "w-new")) == "refused"

        listed = keys / "authorized" / "workers" / "w-old.key"
        dir_mtime = os.stat(listed.parent).st_mtime_ns
        overwrite_in_place(listed, (spare / "w-new.key").read_bytes())
        assert os.stat(listed.parent).st_mtime_ns == dir_mtime

        outcomes = {"w-old": handshake(workers, client_keys(keys, "w-old")),
                    "w-new": handshake(workers, client_keys(keys, "w-new"))}
        record_property("after_overwrite", outcomes)
        assert outcomes == {"w-old": "refused", "w-new": "accepted"}
        # A real worker with the new key registers, with no broker restart.
        new_worker = Proc("worker-new", worker_args("w-new"), tmp_path)
        wait_until(lambda: new_worker.pid in _slot_pids(probe), 60,
                   "the w-new worker to register")
        # ZAP runs only at the handshake, but the broker checks each message's
        # key too: the w-old worker's connection, opened before the overwrite,
        # is dropped from the ledger, and its redial is refused.
        wait_until(lambda: old_worker.pid not in _slot_pids(probe), 30,
                   "the broker to drop the w-old worker's open connection")
        wait_until(lambda: "refused this peer's CURVE public key"
                   in old_worker.log(), 90, "the w-old worker's redial refused")
        snap = probe.status()
        assert [s["pid"] for s in snap["slots"]] == [new_worker.pid]
        assert snap["counters"]["curve_revoked_peers"] == 1
        record_property("curve_revoked_dropped",
                        snap["counters"]["curve_revoked_dropped"])
        assert "authorized workers keys" in broker.log()
        assert "revoked: dropping its worker" in broker.log()
        wait_until(lambda: "llamapool_broker_curve_revoked_peers_total 1.0" in
                   httpx.get(f"http://127.0.0.1:{metrics_port}/metrics",
                             timeout=2).text, 30, "the revocation in /metrics")
        # The same for a frontend-side connection: deleted key, open link.
        doomed = CurveProbe(frontends, client_keys(keys, "f-revoked"))
        try:
            assert doomed.status() is not None
            (keys / "authorized" / "frontends" / "f-revoked.key").unlink()
            wait_until(lambda: doomed.status(timeout_s=1) is None, 30,
                       "the broker to stop answering the revoked frontend key")
            assert probe.status() is not None  # the other frontend key still works
        finally:
            doomed.close()
    finally:
        probe.close()
        codes = [p.stop() for p in (new_worker, old_worker) if p is not None]
        codes.append(broker.stop())
    assert set(codes) == {0}


# --- keygen and directory modes ----------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.stack
def test_keygen_leaves_an_existing_directory_mode_alone(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    shared = tmp_path / "shared"
    (shared / "authorized" / "workers").mkdir(parents=True)
    os.chmod(shared, 0o750)
    os.chmod(shared / "authorized", 0o751)
    os.chmod(shared / "authorized" / "workers", 0o755)
    keygen(private)
    keygen(shared)
    assert mode(private) == 0o700
    assert (mode(shared), mode(shared / "authorized"),
            mode(shared / "authorized" / "workers")) == (0o750, 0o751, 0o755)
    # What keygen creates itself is 0700; secrets 0600, public keys 0644.
    fresh = keygen(tmp_path / "a" / "b")
    for made in (tmp_path / "a", fresh, fresh / "authorized",
                 fresh / "authorized" / "workers", fresh / "authorized" / "frontends",
                 private / "authorized", shared / "authorized" / "frontends"):
        assert mode(made) == 0o700, made
    for out in (private, shared, fresh):
        assert mode(out / "broker.key_secret") == 0o600
        assert mode(out / "worker.key_secret") == 0o600
        assert mode(out / "authorized" / "workers" / "worker.key") == 0o644


@pytest.mark.stack
def test_keygen_upgrades_an_old_layout(tmp_path):
    """An old flat authorized/ gets role directories and a note about the old keys."""
    out = tmp_path / "k"
    (out / "authorized").mkdir(parents=True)
    (out / "authorized" / "worker.key").write_text("stale")
    result = subprocess.run([sys.executable, "-m", "llamapool", "keygen", str(out)],
                            capture_output=True, text=True, check=True)
    assert (out / "authorized" / "workers" / "worker.key").exists()
    assert (out / "authorized" / "frontends" / "frontend.key").exists()
    assert "role-less keys (worker.key)" in result.stdout


# --- the old single directory, and one directory for both roles ------------------


@pytest.mark.stack
def test_old_single_directory_is_refused_with_directions(tmp_path, role_keys):
    base = ["broker", "--frontends", f"ipc://{tmp_path}/f", "--workers",
            f"ipc://{tmp_path}/w",
            "--curve-secret-key", str(role_keys / "broker.key_secret")]
    old = str(role_keys / "authorized")
    as_flag = subprocess.run(cli(*base, "--curve-authorized-dir", old),
                             capture_output=True, text=True, timeout=60)
    as_env = subprocess.run(
        cli(*base, "--curve-authorized-workers", old + "/workers",
            "--curve-authorized-frontends", old + "/frontends"),
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, LLAMAPOOL_CURVE_AUTHORIZED_DIR=old))
    for refused in (as_flag, as_env):
        assert refused.returncode == ExitCode.USAGE, refused.stderr
        assert "--curve-authorized-workers DIR" in refused.stderr
        assert "Traceback" not in refused.stderr
    same = subprocess.run(
        cli(*base, "--curve-authorized-workers", old + "/workers",
            "--curve-authorized-frontends", old + "/workers/."),
        capture_output=True, text=True, timeout=60)
    assert same.returncode == ExitCode.CURVE_KEYS
    assert "same directory" in same.stderr
    half = subprocess.run(cli(*base, "--curve-authorized-workers", old + "/workers"),
                          capture_output=True, text=True, timeout=60)
    assert half.returncode == ExitCode.CURVE_KEYS
    assert "missing: --curve-authorized-frontends" in half.stderr
