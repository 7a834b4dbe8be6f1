"""Token counting without a slot for a chat body (issue 34, item 8):
``POST /v1/chat/completions/input_tokens`` and ``/chat/completions/input_tokens``,
answered as llama-server answers them (``{"object": "response.input_tokens",
"input_tokens": N}``), through real gunicorn, a real broker and workers on
the tiny GGUF."""

from __future__ import annotations

import httpx
import pytest

from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "How many tokens is this?"}]
#: A frontend without the model file: a worker counts.
ungated_pool = pool_fixture(workers=1, frontend_tokenizes=False)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _submitted(pool) -> int:
    return pool.status()["counters"].get("submitted", 0)


def _prompt_tokens(pool, body: dict) -> int:
    r = httpx.post(pool.url + "/v1/chat/completions",
                   json={**body, "max_tokens": 1}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens",
                                  "/chat/completions/input_tokens"])
@pytest.mark.parametrize("extra", [{}, {"stream": True, "temperature": 0.5}],
                         ids=["plain", "generation-fields"])
def test_the_count_is_the_chat_prompts_and_takes_no_slot(whole_pool, path, extra):
    body = {"messages": MESSAGES, **extra}
    before = _submitted(whole_pool)
    r = httpx.post(whole_pool.url + path, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response.input_tokens"
    assert _submitted(whole_pool) == before  # no job, no slot
    assert out["input_tokens"] == _prompt_tokens(
        whole_pool, {"messages": MESSAGES}) > 0


def test_tools_are_counted_or_refused_as_chat_does(whole_pool):
    """The tiny model's template renders no tools: the count is refused
    with chat's 400, not counted without them."""
    body = {"messages": MESSAGES, "tools": TOOLS}
    counted = httpx.post(whole_pool.url + "/v1/chat/completions/input_tokens",
                         json=body, timeout=TIMEOUT_S)
    chat = httpx.post(whole_pool.url + "/v1/chat/completions",
                      json={**body, "max_tokens": 1}, timeout=TIMEOUT_S)
    assert counted.status_code == chat.status_code == 400, counted.text
    assert counted.json()["error"]["code"] == chat.json()["error"]["code"]
    assert counted.json()["error"]["param"] == "tools"


def test_a_bad_chat_body_is_refused_naming_the_field(whole_pool):
    r = httpx.post(whole_pool.url + "/v1/chat/completions/input_tokens",
                   json={"messages": MESSAGES, "bogus_field": 1}, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert "bogus_field" in r.json()["error"]["message"]
    r = httpx.post(whole_pool.url + "/v1/chat/completions/input_tokens",
                   json={"messages": []}, timeout=TIMEOUT_S)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,key", [
    ("/v1/chat/completions/input_tokens", {"messages": MESSAGES}, None),
    ("/v1/responses/input_tokens", {"input": "How many tokens is this?",
                                    "instructions": "Be brief."}, None),
    ("/v1/messages/count_tokens", {"model": "m", "system": "Be brief.",
                                   "messages": MESSAGES[1:]}, "input_tokens"),
])
def test_without_the_vocabulary_a_worker_counts_without_decoding(
        ungated_pool, whole_pool, path, body, key):
    """The count equals the gated frontend's; the worker generated nothing
    (no token counted), and its slot is free again."""
    def counters() -> tuple[int, int]:
        c = ungated_pool.status()["counters"]
        return c.get("submitted", 0), c.get("tokens_relayed", 0)

    submitted, relayed = counters()
    r = httpx.post(ungated_pool.url + path, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    counted = r.json()["input_tokens"]
    gated = httpx.post(whole_pool.url + path, json=body, timeout=TIMEOUT_S)
    assert counted == gated.json()["input_tokens"] > 0
    assert counters() == (submitted + 1, relayed)  # one job, no token
    ungated_pool.wait_free(1, 30)
