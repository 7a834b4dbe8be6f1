"""llama-server parity, second round: the bugs (issue 34, items 1, 3, 4 and 5),
through real gunicorn, a real broker and workers on the tiny GGUF.

1. A non-streamed ``/completion`` whose client gave up ran to the end of
   the context and its lease ended as a normal finish: now the frontend
   looks at the client's socket while it collects, and cancels.
3. ``predicted_per_second`` divided by n tokens: one token reported
   thousands per second, where llama-server divides by its n - 1 decode
   steps (the first token comes from the prompt's logits) and reports 0.
4. ``/apply-template`` dropped ``tools``: a tools template rendered without
   them, and a template without tools answered 200 where chat answers 400.
5. ``truncated`` was always false; llama-server sets it when generation
   stops because the context is full.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pool import wait_until
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

TIMEOUT_S = 120
SMALL_CTX = 64  # llama.cpp rounds it up (to 256)

one_worker = pool_fixture(workers=1)
small_context = pool_fixture(workers=1, worker_args=("--ctx", str(SMALL_CTX)))

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def scrape(pool) -> dict:
    text = httpx.get(pool.url + "/metrics", timeout=TIMEOUT_S).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}


def counter(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


# --- 1. a non-streamed job whose client left -------------------------------------


def test_a_whole_answer_whose_client_left_is_cancelled(one_worker):
    before = scrape(one_worker)
    payload = json.dumps({"prompt": "Hello", "n_predict": -1,
                          "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", one_worker.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    # Left once the job is generating (its slot busy), long before the end
    # of the context.
    wait_until(lambda: one_worker.status()["slots_free"] == 0, 30,
               "the job to take the slot")
    sock.close()
    one_worker.wait_free(1, 30)
    after = scrape(one_worker)
    assert counter(after, "llamapool_requests_cancelled_total") == \
        counter(before, "llamapool_requests_cancelled_total") + 1
    generated = counter(after, "llama_tokens_generated_total") - \
        counter(before, "llama_tokens_generated_total")
    assert generated < 2048 - 8, generated  # not run to the end of the context


# --- 3. rates over decode steps ---------------------------------------------------


def test_one_token_has_no_decode_rate_and_more_are_over_n_minus_one(one_worker):
    one = httpx.post(one_worker.url + "/completion", timeout=TIMEOUT_S, json={
        "prompt": "Hello", "n_predict": 1, "ignore_eos": True}).json()["timings"]
    assert one["predicted_n"] == 1
    assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    six = httpx.post(one_worker.url + "/completion", timeout=TIMEOUT_S, json={
        "prompt": "Hello", "n_predict": 6, "ignore_eos": True}).json()["timings"]
    assert six["predicted_n"] == 6
    assert six["predicted_per_second"] == pytest.approx(
        5 / six["predicted_ms"] * 1000, rel=1e-9)
    assert six["predicted_per_token_ms"] == pytest.approx(
        six["predicted_ms"] / 5, rel=1e-9)


# --- 4. /apply-template with tools ------------------------------------------------


@pytest.fixture(scope="module")
def tools_pool(tmp_path_factory, pool_factory):
    path = tmp_path_factory.mktemp("tools-model") / "tiny-tools.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    "--tools-template", str(path)], check=True, capture_output=True)
    with pool_factory(model=path, workers=1) as pool:
        yield pool


def test_apply_template_renders_tools_as_chat_does(tools_pool):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = httpx.post(tools_pool.url + "/apply-template", timeout=TIMEOUT_S,
                            json={"messages": messages, "tools": TOOLS})
    without = httpx.post(tools_pool.url + "/apply-template", timeout=TIMEOUT_S,
                         json={"messages": messages})
    assert with_tools.status_code == without.status_code == 200
    rendered = with_tools.json()["prompt"]
    assert "get_weather" in rendered and "get_weather" not in without.json()["prompt"]
    # The same prompt the chat endpoint generates from: its token count.
    n_rendered = len(httpx.post(tools_pool.url + "/tokenize", timeout=TIMEOUT_S, json={
        "content": rendered, "add_special": False, "parse_special": True}
    ).json()["tokens"])
    chat = httpx.post(tools_pool.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": messages, "tools": TOOLS, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert abs(chat.json()["usage"]["prompt_tokens"] - n_rendered) <= 1  # BOS


def test_apply_template_refuses_tools_where_chat_does(one_worker):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    applied = httpx.post(one_worker.url + "/apply-template", json=body,
                         timeout=TIMEOUT_S)
    chat = httpx.post(one_worker.url + "/v1/chat/completions", timeout=TIMEOUT_S,
                      json={**body, "max_tokens": 1})
    assert applied.status_code == chat.status_code == 400, (applied.text, chat.text)
    assert applied.json()["error"]["param"] == "tools"


# --- 5. truncated ------------------------------------------------------------------


def test_truncated_when_the_context_ends_generation(small_context):
    full = httpx.post(small_context.url + "/completion", timeout=TIMEOUT_S, json={
        "prompt": "Hello", "n_predict": -1, "ignore_eos": True}).json()
    assert full["truncated"] is True, full
    n_ctx = httpx.get(small_context.url + "/slots", timeout=TIMEOUT_S).json()[0]["n_ctx"]
    assert full["tokens_evaluated"] + full["tokens_predicted"] == n_ctx
    short = httpx.post(small_context.url + "/completion", timeout=TIMEOUT_S, json={
        "prompt": "Hello", "n_predict": 4, "ignore_eos": True}).json()
    assert short["truncated"] is False and short["tokens_predicted"] == 4
