"""Soak (``make soak``; skipped unless ``LLAMAPOOL_SOAK=1``): a worker that
every job pins in native code, cancelled again and again under ``llamapool
up`` (issue 29, item 1).

More stuck cancels in a row than ``up``'s crash-loop hold allows crashes
(``HOLD_AFTER_CRASHES``): each one ends the worker (exit 8) and ``up``
starts a fresh one at once, never holding it, with no backoff growing, and
the ledger is whole after each (one slot, idle, a new pid).
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from llamapool.supervisor import HOLD_AFTER_CRASHES
from tests.faults.conftest import figures
from tests.pool import Proc, cli, free_port, wait_until
from tests.test_cancel_deadline import children, full_log, pid_alive

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(os.environ.get("LLAMAPOOL_SOAK") != "1",
                       reason="a soak run: make soak (LLAMAPOOL_SOAK=1)"),
]

CYCLES = HOLD_AFTER_CRASHES + 3
CANCEL_TIMEOUT_S = 2.0


def test_stuck_cancels_in_a_row_are_restarted_never_held(tiny_model, tmp_path):
    fig = figures("29.1 stuck cancels in a row under up")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "1",
                        "--port", str(port), "--threads", "1",
                        "--heartbeat-interval-s", "0.2"), tmp_path,
              env={**os.environ, "LLAMAPOOL_TEST_HANG": "job",
                   "LLAMAPOOL_FRAME_TIMEOUT_S": "1",
                   "LLAMAPOOL_CANCEL_TIMEOUT_S": str(CANCEL_TIMEOUT_S)})

    def idle_pid(not_this: int | None) -> int | None:
        try:
            (slot,) = httpx.get(url + "/slots", timeout=2).json()
        except (httpx.TransportError, ValueError):
            return None
        return (slot["pid"] if slot["state"] == "idle" and slot["pid"] != not_this
                else None)

    left = set()
    try:
        wait_until(lambda: "llamapool ready at" in up.log(), 60, "the ready line")
        pid = wait_until(lambda: idle_pid(None), 30, "the worker")
        for _ in range(CYCLES):
            started = time.monotonic()
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"prompt": "Hi", "max_tokens": 4})
            assert r.status_code == 504, r.text
            new = wait_until(lambda p=pid: idle_pid(p), 60, "a fresh worker")
            fig.faults += 1
            fig.recovery_s.append(time.monotonic() - started)
            assert not pid_alive(pid)
            pid = new
            left |= set(children(up.pid))
        log = full_log(up)
        assert len(re.findall(r"exited with 8 .*; restarting it now", log)) == CYCLES
        assert "held after" not in log and "restarting in" not in log
        fig.notes = (f"{CYCLES} in a row (hold after {HOLD_AFTER_CRASHES} "
                     "crashes): none held")
    finally:
        left |= set(children(up.pid))
        try:
            up.stop()
        finally:
            for p in left:
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)
