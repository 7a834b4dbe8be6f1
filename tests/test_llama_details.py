"""llama.cpp's server details that clients rely on, through a real pool.

Issue 11, section 3: the role-only first chunk of a streamed chat, the full
``timings`` set (and ``timings_per_token``), llama.cpp's
``exceed_context_size_error`` body from the frontend's gate and from a worker,
``system_fingerprint``, and the refusal of two trailing assistant messages.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.pool import Pool, sse_events
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms",
                "prompt_per_second", "predicted_n", "predicted_ms",
                "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture
def client(whole_pool):
    return openai.OpenAI(base_url=whole_pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


#: No ``--model`` for the frontend: a worker counts the prompt.
ungated_pool = pool_fixture(workers=1, frontend_tokenizes=False)


def stream(pool: Pool, path: str, body: dict) -> list:
    with httpx.stream("POST", pool.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def assert_consistent(t: dict) -> None:
    """Rates derived from counts and times, as llama.cpp derives them: the
    generation's over its decode steps, one fewer than its tokens (the first
    comes from the prompt's logits)."""
    assert set(t) == TIMINGS_KEYS
    for n, ms, per_token, per_second, first_is_free in (
            ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
             False),
            ("predicted_n", "predicted_ms", "predicted_per_token_ms",
             "predicted_per_second", True)):
        assert t[n] >= 0 and t[ms] >= 0
        steps = max(t[n] - 1, 0) if first_is_free else t[n]
        expect_per_token = t[ms] / steps if steps else 0.0
        expect_per_second = steps / t[ms] * 1000 if t[ms] else 0.0
        assert math.isclose(t[per_token], expect_per_token, rel_tol=1e-9)
        assert math.isclose(t[per_second], expect_per_second, rel_tol=1e-9)


# --- the first chunk of a streamed chat ------------------------------------------


def test_streamed_chat_starts_with_a_role_only_chunk_raw(whole_pool):
    events = stream(whole_pool, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
        "ignore_eos": True})
    assert events[-1] == "[DONE]"
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0,
                                 "delta": {"role": "assistant", "content": None},
                                 "logprobs": None, "finish_reason": None}]
    # Only the first chunk names the role; the text follows in its own chunks.
    rest = events[1:-1]
    assert all("role" not in e["choices"][0]["delta"] for e in rest)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in rest)


def test_streamed_chat_first_chunk_with_the_openai_client(client):
    chunks = list(client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content) == ("assistant", None)
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "length"


# A stream with no text still names the role first: in process, in
# tests/test_frontend_inproc.py.


# --- timings ----------------------------------------------------------------------


def test_whole_response_has_llama_cpp_timings(whole_pool):
    r = httpx.post(whole_pool.url + "/v1/completions", json={
        "prompt": "Hello world", "max_tokens": 6, "ignore_eos": True}, timeout=60)
    body = r.json()
    t = body["timings"]
    assert_consistent(t)
    assert t["predicted_n"] == 6 == body["usage"]["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == body["usage"]["prompt_tokens"]
    assert t["cache_n"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0


def test_usage_chunk_carries_timings_too(whole_pool):
    events = stream(whole_pool, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    finishing, usage_chunk = events[-3], events[-2]
    assert finishing["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]
    assert usage_chunk["timings"] == finishing["timings"]
    assert_consistent(usage_chunk["timings"])
    assert usage_chunk["timings"]["predicted_n"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello world"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_timings_per_token_puts_timings_on_every_chunk(whole_pool, path, body):
    events = stream(whole_pool, path, {**body, "max_tokens": 8,
                                       "ignore_eos": True,
                                       "timings_per_token": True})
    # Text chunks: not the role-only first one, not the finishing one.
    chunks = [e for e in events[:-1]
              if e["choices"][0]["finish_reason"] is None
              and "role" not in e["choices"][0].get("delta", {})]
    assert chunks, events
    assert all("timings" in c for c in chunks)
    counts = [c["timings"]["predicted_n"] for c in chunks]
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= 8
    prompt_ms = {c["timings"]["prompt_ms"] for c in chunks}
    assert len(prompt_ms) == 1  # the prompt was evaluated once
    for c in chunks:
        assert_consistent(c["timings"])
    assert events[-2]["timings"]["predicted_n"] == 8


def test_without_timings_per_token_text_chunks_have_none(whole_pool):
    events = stream(whole_pool, "/v1/completions", {
        "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert all("timings" not in e for e in events[:-2])
    assert "timings" in events[-2]


# timings_per_token must be a boolean: in process, in
# tests/test_frontend_inproc.py.


# --- a prompt longer than the context ------------------------------------------------


def assert_exceed_context_body(r: httpx.Response, n_ctx: int) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["code"] == "context_length_exceeded"
    assert error["n_ctx"] == n_ctx
    assert error["n_prompt_tokens"] >= n_ctx
    # llama.cpp's words, with its numbers.
    assert error["message"].startswith("request (")
    assert error["message"].endswith(
        f" tokens) exceeds the available context size ({n_ctx} tokens), "
        "try increasing it")
    return error


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello " * 2100}),
    ("/v1/chat/completions", {"messages": [{"role": "user",
                                            "content": "world " * 2100}]}),
])
def test_prompt_over_the_context_at_the_frontend_gate(whole_pool, path, body):
    before = whole_pool.status()["counters"].get("submitted", 0)
    r = httpx.post(whole_pool.url + path, json=body, timeout=60)
    assert_exceed_context_body(r, 2048)
    assert whole_pool.status()["counters"].get("submitted", 0) == before


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello " * 2100}),
    ("/v1/chat/completions", {"messages": [{"role": "user",
                                            "content": "world " * 2100}]}),
])
def test_prompt_over_the_context_at_the_worker(ungated_pool, path, body):
    r = httpx.post(ungated_pool.url + path, json=body, timeout=60)
    assert_exceed_context_body(r, 2048)
    ungated_pool.assert_whole()


def test_exact_count_when_the_whole_prompt_was_counted(ungated_pool):
    # Just over the context: tokenised to the end, so the count is exact.
    r = httpx.post(ungated_pool.url + "/v1/completions",
                   json={"prompt": "Hello " * 2050}, timeout=60)
    error = assert_exceed_context_body(r, 2048)
    assert "at least" not in error["message"]
    assert error["message"].startswith(f"request ({error['n_prompt_tokens']} ")


# --- system_fingerprint -----------------------------------------------------------


def test_system_fingerprint_on_whole_and_streamed_responses(client, whole_pool):
    whole = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    fp = whole.system_fingerprint
    assert fp and fp.startswith("llamapool-0.1.0-llama-cpp-python-0.3.36-")
    chunks = list(client.completions.create(
        model="x", prompt="Hi", max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert {c.system_fingerprint for c in chunks} == {fp}
    again = client.completions.create(model="y", prompt="Hi", max_tokens=1)
    assert again.system_fingerprint == fp  # stable: same build, same model


# --- two assistant messages at the end ---------------------------------------------


# Two are refused before any worker sees them: in process, in
# tests/test_frontend_inproc.py.


def test_one_trailing_assistant_message_is_answered(whole_pool):
    r = httpx.post(whole_pool.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello"}],
        "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    body = json.loads(r.text)
    assert body["choices"][0]["message"]["role"] == "assistant"
