"""``--flash-attn on|off`` (llama.cpp's flash attention) through real
processes: ``up`` hands it to every worker, a worker refuses any other value,
and the engine gives it to ``Llama(...)`` (read back from the context's
parameters). On by default, as llama-server's ``-fa auto`` is on every CPU
build; ``off`` keeps a prompt continued from a cached state generating
exactly what a cold prefill does (the settings module says why)."""

from __future__ import annotations

import os

import llama_cpp
import pytest

from tests.faults.test_up_supervision import idle_slots
from tests.pool import Proc, cli, free_port, wait_until


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [part.decode() for part in f.read().split(b"\0") if part]


@pytest.mark.stack
def test_up_hands_the_setting_to_every_worker(tiny_model, tmp_path):
    port = free_port()
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "2",
                        "--port", str(port), "--threads", "1",
                        "--flash-attn", "on"), tmp_path)
    try:
        slots = wait_until(lambda: idle_slots(f"http://127.0.0.1:{port}"), 90,
                           "2 idle slots")
        for slot in slots:
            argv = cmdline(slot["pid"])
            assert argv[argv.index("--flash-attn") + 1] == "on"
    finally:
        up.stop()


@pytest.mark.stack
def test_a_worker_refuses_anything_but_on_or_off(tiny_model, tmp_path):
    bad = Proc("bad", cli("worker", "--broker", "tcp://127.0.0.1:1", "--model",
                          str(tiny_model)), tmp_path,
               env=dict(os.environ, LLAMAPOOL_FLASH_ATTN="auto"))
    assert bad.popen.wait(60) != 0
    assert "LLAMAPOOL_FLASH_ATTN='auto': on or off" in bad.log()


@pytest.mark.parametrize("env, expected", [
    ({}, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
    ({"LLAMAPOOL_FLASH_ATTN": "off"}, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED),
])
@pytest.mark.parametrize("n_slots", [1, 2])
def test_a_workers_engine_has_it_on_unless_told_off(tiny_model, env, expected,
                                                    n_slots):
    from protocol import settings as config
    from workers.model.engines import load_engine
    from workers.model.settings import WorkerSettings

    settings = config.load(WorkerSettings, env, flags={
        "broker_endpoint": "ipc:///nobody", "model_path": str(tiny_model),
        "n_ctx": 256, "n_threads": "1", "n_slots": n_slots})
    engine = load_engine(settings)
    assert engine.llama.context_params.flash_attn_type == expected


@pytest.mark.parametrize("given, expected", [
    ({}, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED),
    ({"flash_attn": True}, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
    ({"flash_attn": False}, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED),
])
def test_the_engine_gives_it_to_llama(tiny_model, given, expected):
    from workers.model.llama_engine import LlamaEngine

    engine = LlamaEngine(str(tiny_model), n_ctx=256, n_threads=1, **given)
    assert engine.llama.context_params.flash_attn_type == expected
