"""The CURVE role attacks, measured against whatever checkout is on PYTHONPATH.

    make bench-curve-roles   # or: python -m tests.bench.curve_roles_attacks

Runs the real CLI (broker, synthetic workers, gunicorn frontends) on loopback
with the keys ``llamapool keygen`` writes, configured the way that checkout
allows: one ``--curve-authorized-dir`` before keys had roles, one directory
per role after. Then, and prints one markdown row per attack:

1. A worker holding the *frontend's* key pair: does it get a slot, and how
   many of N completions (their prompts) reach it?
2. A gunicorn frontend holding the *worker's* key pair: how many of N
   completions does it get served?
3. A listed key overwritten in place (same inode, size and mtime, as
   ``cp -p`` does): is the old key still accepted, the new one refused?
4. A listed worker key deleted while that worker's connection is open: is
   the worker dropped (and how fast), or does it keep its slot?
5. ``llamapool keygen`` into an existing 0700 directory: its mode after.

The same script runs on the base commit (copy it there) for the "before"
column; nothing here imports code that only the fix has.
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import curve
from tests.pool import BrokerProbe, Proc, cli, free_port, wait_until

HEARTBEAT = ("--heartbeat-interval-s", "0.2", "--heartbeat-liveness", "3")


def has_roles() -> bool:
    """Whether this checkout's broker takes one directory per role."""
    out = subprocess.run(cli("broker", "--help"), capture_output=True, text=True)
    return "--curve-authorized-workers" in out.stdout


def keygen(directory: Path, *args: str) -> Path:
    subprocess.run([sys.executable, "-m", "llamapool", "keygen", str(directory),
                    *args], check=True, capture_output=True)
    return directory


def authorized_args(keys: Path, roles: bool) -> list[str]:
    if roles:
        return ["--curve-authorized-workers", str(keys / "authorized" / "workers"),
                "--curve-authorized-frontends",
                str(keys / "authorized" / "frontends")]
    return ["--curve-authorized-dir", str(keys / "authorized")]


def client_keys(keys: Path, name: str) -> curve.ClientKeys:
    return curve.ClientKeys.from_files(keys / "broker.key",
                                       keys / f"{name}.key_secret")


def handshake(endpoint: str, keys: curve.ClientKeys, timeout_s: float = 20) -> str:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.apply(sock, watch=False)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        if monitor.poll(timeout_s * 1000):
            event = recv_monitor_message(monitor)["event"]
            return "accepted" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
        return "no answer"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


class Stack:
    """A CURVE broker on loopback and the processes started against it."""

    def __init__(self, run: Path, keys: Path, roles: bool) -> None:
        self.run, self.keys = run, keys
        self.frontends = f"tcp://127.0.0.1:{free_port()}"
        self.workers = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Proc] = []
        self.broker = self._spawn("broker", cli(
            "broker", "--frontends", self.frontends, "--workers", self.workers,
            "--curve-secret-key", str(keys / "broker.key_secret"),
            *authorized_args(keys, roles), *HEARTBEAT))
        self.probe = BrokerProbe(self.frontends, client_keys(keys, "frontend"))

    def _spawn(self, name: str, argv: list[str], env=None) -> Proc:
        proc = Proc(name, argv, self.run, env=env)
        self.procs.append(proc)
        return proc

    def worker(self, name: str, key: str) -> Proc:
        return self._spawn(name, cli(
            "worker", "--broker", self.workers, "--engine", "synthetic",
            "--tokens-per-second", "500", "--worker-name", name,
            "--curve-server-key", str(self.keys / "broker.key"),
            "--curve-secret-key", str(self.keys / f"{key}.key_secret"), *HEARTBEAT))

    def frontend(self, name: str, key: str) -> str:
        port = free_port()
        env = dict(os.environ, LLAMAPOOL_FRONTEND_PROCESSES="1",
                   LLAMAPOOL_SUBMIT_TIMEOUT_S="2")
        self._spawn(name, cli(
            "frontend", "--broker", self.frontends, "--bind", f"127.0.0.1:{port}",
            "--curve-server-key", str(self.keys / "broker.key"),
            "--curve-secret-key", str(self.keys / f"{key}.key_secret"),
            *HEARTBEAT), env=env)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url), 60, f"{name} to answer HTTP")
        return url

    def status(self) -> dict:
        return wait_until(lambda: self.probe.status(timeout_s=1), 30, "STATUS")

    def close(self) -> None:
        self.probe.close()
        for proc in reversed(self.procs):
            proc.stop()


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def complete(url: str, n: int) -> int:
    """Send ``n`` completions; how many were served (HTTP 200)."""
    served = 0
    for i in range(n):
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"prompt": f"private prompt {i}", "max_tokens": 4})
        served += r.status_code == 200
    return served


def frontend_key_as_worker(run: Path, keys: Path, roles: bool, n: int) -> str:
    stack = Stack(run, keys, roles)
    try:
        legit = stack.worker("legit", "worker")
        wait_until(lambda: stack.status()["slots_total"] >= 1, 60, "legit worker")
        impostor = stack.worker("impostor", "frontend")

        def decided():
            snap = stack.status()
            refused = snap["counters"].get("curve_refused", 0)
            return snap["slots_total"] >= 2 or refused >= 1

        wait_until(decided, 60, "the impostor's handshake")
        url = stack.frontend("frontend", "frontend")
        complete(url, n)
        slots = {s["pid"]: s for s in stack.status()["slots"]}
        got = slots.get(impostor.pid)
        assert legit.pid in slots
        if got is None:
            return f"refused: no slot, 0/{n} prompts"
        return f"registered: a slot, {got['jobs_served']}/{n} prompts"
    finally:
        stack.close()


def worker_key_as_frontend(run: Path, keys: Path, roles: bool, n: int) -> str:
    stack = Stack(run, keys, roles)
    try:
        stack.worker("legit", "worker")
        wait_until(lambda: stack.status()["slots_total"] >= 1, 60, "legit worker")
        url = stack.frontend("impostor-frontend", "worker")
        served = complete(url, n)
        submitted = stack.status()["counters"].get("submitted", 0)
        return f"{served}/{n} served, {submitted} SUBMITs reached the broker"
    finally:
        stack.close()


def overwritten_key(run: Path, keys: Path, spare: Path, roles: bool) -> str:
    listed_dir = keys / "authorized" / ("workers" if roles else "")
    listed = listed_dir / "worker.key"
    stack = Stack(run, keys, roles)
    try:
        before = handshake(stack.workers, client_keys(keys, "worker"))
        assert before == "accepted", before
        st = os.stat(listed)
        with open(listed, "r+b") as f:
            f.write((spare / "worker.key").read_bytes())
            f.truncate()
        os.utime(listed, ns=(st.st_atime_ns, st.st_mtime_ns))
        (keys / "spare.key_secret").write_bytes(
            (spare / "worker.key_secret").read_bytes())
        old = handshake(stack.workers, client_keys(keys, "worker"))
        new = handshake(stack.workers, client_keys(keys, "spare"))
        return f"old key {old}, new key {new}"
    finally:
        stack.close()


def revoked_open_connection(run: Path, keys: Path, roles: bool) -> str:
    listed = keys / "authorized" / ("workers" if roles else "") / "worker.key"
    stack = Stack(run, keys, roles)
    try:
        worker = stack.worker("revoked", "worker")
        wait_until(lambda: stack.status()["slots_total"] == 1, 60, "the worker")
        listed.unlink()
        revoked_at = time.monotonic()
        deadline = revoked_at + 10
        while time.monotonic() < deadline:
            if worker.pid not in [s["pid"] for s in stack.status()["slots"]]:
                return f"dropped after {time.monotonic() - revoked_at:.1f} s"
            time.sleep(0.05)
        return "still registered 10 s later"
    finally:
        stack.close()


def keygen_mode(tmp: Path) -> str:
    out = tmp / "mode-check"
    out.mkdir()
    os.chmod(out, 0o700)
    keygen(out)
    return f"{stat.S_IMODE(os.stat(out).st_mode):04o}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    roles = has_roles()
    rows = []
    with tempfile.TemporaryDirectory(prefix="curve-roles-") as tmp:
        tmp_path = Path(tmp)
        keys = keygen(tmp_path / "keys")
        spare = keygen(tmp_path / "spare")
        for name, run in [
            ("frontend's key registers as a worker",
             lambda r: frontend_key_as_worker(r, keys, roles, args.requests)),
            ("worker's key submits jobs",
             lambda r: worker_key_as_frontend(r, keys, roles, args.requests)),
            ("listed key overwritten in place",
             lambda r: overwritten_key(r, keys, spare, roles)),
            ("listed key deleted, its worker's link open",
             lambda r: revoked_open_connection(r, keygen(tmp_path / "keys2"), roles)),
            ("keygen into an existing 0700 dir", lambda r: keygen_mode(r)),
        ]:
            run_dir = Path(tempfile.mkdtemp(dir=tmp_path))
            started = time.monotonic()
            rows.append((name, run(run_dir), time.monotonic() - started))
    print(f"checkout: {'one directory per role' if roles else 'one directory'}")
    print("| attack | result | s |")
    print("|---|---|---|")
    for name, result, seconds in rows:
        print(f"| {name} | {result} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
