"""GPU settings through real processes: ``llamapool up --gpus 0,1
--gpu-layers N`` gives each worker one device (``CUDA_VISIBLE_DEVICES``) and
llama.cpp the layer count, and ``/slots`` says where the layers are.

This machine has no GPU and ``make serve`` installs the CPU build of
llama-cpp-python, so nothing is offloaded: the test checks that the settings
reach the worker's environment and ``Llama(...)`` (read back from the loaded
model's parameters), and that ``/slots`` reports 0 layers offloaded rather
than what was asked.
"""

from __future__ import annotations

import httpx
import llama_cpp
import pytest

from tests.faults.test_up_supervision import idle_slots
from tests.pool import Proc, cli, free_port, wait_until


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


@pytest.mark.stack
def test_up_gives_each_worker_a_gpu_and_the_layer_count(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "2",
                        "--port", str(port), "--threads", "1",
                        "--gpus", "0,1", "--gpu-layers", "99"), tmp_path)
    try:
        slots = wait_until(lambda: idle_slots(url), 90, "2 idle slots")
        devices = sorted(environ(s["pid"])["CUDA_VISIBLE_DEVICES"] for s in slots)
        assert devices == ["0", "1"]
        offloaded = 99 if llama_cpp.llama_supports_gpu_offload() else 0
        for slot in slots:
            gpu = slot["gpu"]
            assert gpu["devices"] == environ(slot["pid"])["CUDA_VISIBLE_DEVICES"]
            # Read back from Llama.model_params: what llama.cpp was given.
            assert gpu["layers_requested"] == 99
            # A GPU build offloads every layer the tiny model has (fewer
            # than 99); a CPU build none.
            assert (gpu["layers_offloaded"] > 0) == (offloaded > 0)
        # The pool still serves (on the CPU here).
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        up.stop()


@pytest.mark.stack
def test_default_is_cpu_and_bad_values_are_refused(tiny_model, tmp_path):
    bad = Proc("bad", cli("worker", "--broker", "tcp://127.0.0.1:1", "--model",
                          str(tiny_model), "--gpu-layers", "-2"), tmp_path)
    assert bad.popen.wait(60) != 0
    assert "LLAMAPOOL_GPU_LAYERS=-2" in bad.log()
    bad_up = Proc("bad-up", cli("up", "--model", str(tiny_model), "--gpus", "0,0"),
                  tmp_path)
    assert bad_up.popen.wait(60) != 0
    assert "distinct ids" in bad_up.log()


@pytest.mark.parametrize("layers", [0, -1])
def test_the_engine_passes_the_count_to_llama(tiny_model, layers):
    from workers.model.llama_engine import LlamaEngine

    engine = LlamaEngine(str(tiny_model), n_ctx=256, n_threads=1, n_gpu_layers=layers)
    # llama-cpp-python passes -1 (all) on as INT32_MAX.
    assert engine.llama.model_params.n_gpu_layers == (layers if layers >= 0
                                                      else 0x7FFFFFFF)
    assert engine.gpu.layers_requested == layers
    if not llama_cpp.llama_supports_gpu_offload():
        assert engine.gpu.layers_offloaded == 0
