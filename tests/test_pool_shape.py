"""``llamapool up``'s default shape (``llamapool.pool_shape``): one worker of
two batched slots on an AMX CPU, two one-slot workers elsewhere, and what
a flag given keeps as it was; then the real ``up`` on this host."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

import httpx
import pytest

from llamapool.pool_shape import PoolShape, pool_shape
from tests.pool import free_port, wait_until

AMX = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
AVX2 = frozenset({"avx2", "fma"})


def test_an_amx_cpu_gets_one_worker_of_two_batched_slots():
    shape = pool_shape(None, None, flags=AMX)
    assert (shape.workers, shape.slots_per_worker) == (1, 2)
    assert "AMX" in shape.reason


def test_another_cpu_gets_two_one_slot_workers():
    assert pool_shape(None, None, flags=AVX2) == PoolShape(
        2, 1, "auto: one slot per worker on this CPU")


@pytest.mark.parametrize("given, expected", [
    ({"workers": 3}, (3, 1)),
    ({"slots_per_worker": 4}, (2, 4)),
    ({"workers": 1, "slots_per_worker": 1}, (1, 1)),
    ({"models_file": True}, (2, 1)),
    ({"gpus": True}, (2, 1)),
    ({"engine": "synthetic"}, (2, 1)),
    ({"threads": "auto"}, (2, 1)),
])
def test_a_pool_sized_on_purpose_is_not_reshaped(given, expected):
    workers = given.pop("workers", None)
    slots = given.pop("slots_per_worker", None)
    shape = pool_shape(workers, slots, flags=AMX, **given)
    assert (shape.workers, shape.slots_per_worker, shape.reason) == (*expected, "given")


@pytest.mark.stack
def test_up_without_flags_starts_the_shape_this_host_gets(tiny_model):
    expected = pool_shape(None, None)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llamapool", "up", "--model", str(tiny_model),
         "--port", str(port), "--heartbeat-interval-s", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                return httpx.get(url + "/health", timeout=2).json().get(
                    "slots_idle") == 2
            return False
        wait_until(ready, 120, "two idle slots")
        listed = httpx.get(url + "/slots", timeout=5).json()
        pids = {slot["pid"] for slot in listed}
        assert len(pids) == expected.workers, (expected, listed)
        resp = httpx.post(url + "/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output.decode(errors="replace")[-2000:]
    if expected.reason != "given":
        assert expected.reason in output.decode(errors="replace")
