"""``llamapool up`` restarts what dies: a worker, the broker; stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.faults.conftest import figures
from tests.pool import Proc, cli, free_port, wait_until

pytestmark = pytest.mark.stack


def children(pid: int) -> dict[int, str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = {}
    for child in out.stdout.split():
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[int(child)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def idle_slots(url: str) -> list[dict] | None:
    try:
        slots = httpx.get(url + "/slots", timeout=2).json()
    except (httpx.TransportError, ValueError):
        return None
    return slots if len(slots) == 2 and all(s["state"] == "idle" for s in slots) \
        else None


def test_up_restarts_a_dead_worker_and_broker(tiny_model, tmp_path):
    fig = figures("7. llamapool up: worker and broker killed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "2",
                        "--port", str(port), "--threads", "1",
                        "--heartbeat-interval-s", "0.2"), tmp_path)
    try:
        wait_until(lambda: "llamapool ready at" in up.log(), 60, "the ready line")
        before = wait_until(lambda: idle_slots(url), 30, "2 idle slots")
        kids = children(up.pid)

        victim = before[0]["pid"]
        fault_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        fig.faults += 1
        after = wait_until(
            lambda: (s := idle_slots(url)) and victim not in {x["pid"] for x in s}
            and s, 30, "the worker to be restarted and registered")
        fig.recovery_s.append(time.monotonic() - fault_at)
        assert len({s["pid"] for s in after}) == 2

        broker_pid = next(p for p, cmd in kids.items() if " broker " in cmd)
        fault_at = time.monotonic()
        os.kill(broker_pid, signal.SIGKILL)
        fig.faults += 1
        wait_until(lambda: broker_pid not in children(up.pid)
                   and idle_slots(url), 60, "a new broker with both workers back")
        fig.recovery_s.append(time.monotonic() - fault_at)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200
        everything = set(children(up.pid))
        everything |= {g for c in list(everything) for g in children(c)}  # gunicorn
    finally:
        code = up.stop()
    assert code == 0
    leftovers = [p for p in everything if pid_alive(p)]
    assert not leftovers, f"processes left behind: {leftovers}"
