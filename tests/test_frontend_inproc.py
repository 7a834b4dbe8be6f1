"""The frontend's own logic, in process: keys, bad bodies, headers, SSE shape.

The app from ``create_app`` is driven with Falcon's ``TestClient`` against a
real broker and real workers with the synthetic engine, all in threads on
``inproc://`` (``tests/inproc_pool.py``): no process starts, so this module
is part of ``make test-unit``. Each claim here is also tested through real
gunicorn and real processes: ``tests/test_http_edges.py`` (keys, refused
bodies that never reach a worker), ``tests/test_llama_details.py`` (the
role-only first chunk), ``tests/test_openai_client.py`` (the stream's
shape, read by the ``openai`` client), ``tests/test_embeddings.py`` (400s
from the workers), ``tests/test_observability.py`` (X-Request-Id).

Refused requests are checked to reach no worker: the broker's ``submitted``
counter (``finished`` for embeddings) must not move.
"""

from __future__ import annotations

import json

import pytest

from frontend.web_page import PAGE_FILES
from tests.inproc_pool import sse_events

KEY = "sk-inproc-Zq81-unique-key-7731"
AUTH = {"X-Api-Key": KEY}
INVALID = {"error": {"message": "Invalid API Key", "type": "authentication_error"}}
PUBLIC = ["/health", "/v1/health", "/models", "/v1/models", "/", *PAGE_FILES]


@pytest.fixture(scope="module")
def keyed(inproc_pool):
    """Two keys and a 64 KiB body limit, as ``test_http_edges``'s pool."""
    return inproc_pool.client(api_keys=(KEY, "second-key"), max_body_bytes=65536)


@pytest.fixture(scope="module")
def open_client(inproc_pool):
    """No keys: every endpoint is open."""
    return inproc_pool.client()


@pytest.fixture
def unsubmitted(inproc_pool):
    """The test's requests must reach no worker."""
    before = inproc_pool.submitted()
    yield
    assert inproc_pool.submitted() == before


def post(client, path: str = "/v1/completions", body=None, headers=None, **kw):
    if body is not None:
        kw["json"] = body
    return client.simulate_post(path, headers={**AUTH, **(headers or {})}, **kw)


# --- keys ------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {KEY}"},
    {"X-Api-Key": "wrong"},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {KEY}x"},
])
def test_missing_or_bad_key_gets_401(keyed, headers, unsubmitted):
    r = keyed.simulate_post("/v1/completions", headers=headers,
                            json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 401
    assert r.json == INVALID


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEY}"},
    {"authorization": f"bearer {KEY}"},
    {"X-Api-Key": KEY},
    {"Authorization": "Bearer second-key"},
])
def test_good_key_in_either_header(keyed, headers):
    r = keyed.simulate_post("/v1/completions", headers=headers,
                            json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json["choices"][0]["text"] == "tok0 tok1"


@pytest.mark.parametrize("path", PUBLIC)
def test_public_endpoints_need_no_key(keyed, path):
    r = keyed.simulate_get(path)
    assert r.status_code == 200, r.text


def test_slots_and_metrics_are_protected(keyed, inproc_pool):
    assert keyed.simulate_get("/slots").status_code == 401
    assert keyed.simulate_get("/metrics").status_code == 401
    r = keyed.simulate_get("/slots", headers=AUTH)
    assert r.status_code == 200
    assert len(r.json) == inproc_pool.n_workers
    assert {slot["engine"] for slot in r.json} == {"synthetic"}


# --- bad bodies: 400 naming the field, and no job ----------------------------------


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hi", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "n": 2}, "n"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "temperature": 9}, "temperature"),
    ({"prompt": "Hi", "stop": [1, 2]}, "stop"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "seed": -5}, "seed"),
    ({"prompt": "Hi", "timings_per_token": "yes"}, "timings_per_token"),
])
def test_bad_completion_field_is_400_naming_it(keyed, body, param, unsubmitted):
    r = post(keyed, body=body)
    assert r.status_code == 400, r.text
    error = r.json["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
     "max_completion_tokens"),
])
def test_bad_chat_field_is_400(keyed, body, param, unsubmitted):
    r = post(keyed, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json["error"]["param"] == param


def test_two_trailing_assistant_messages_are_refused(keyed, unsubmitted):
    r = post(keyed, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello"},
                     {"role": "assistant", "content": "there"}]})
    assert r.status_code == 400
    error = r.json["error"]
    assert error["message"] == ("Cannot have 2 or more assistant messages at "
                                "the end of the list.")
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
def test_malformed_json_is_400(keyed, raw, unsubmitted):
    r = keyed.simulate_post("/v1/completions", body=raw,
                            headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_413(keyed, unsubmitted):
    r = post(keyed, body={"prompt": "x" * 70000})
    assert r.status_code == 413
    assert r.json["error"]["code"] == "request_too_large"


DEEP = b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
HUGE_INT = b"1" + b"0" * 400  # 10**400: valid JSON, beyond any wire integer


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", DEEP, None),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ' + HUGE_INT + b"}",
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": {"a": 1}, "content": "x"}]}',
     "messages[0].role"),
], ids=["nested-2000", "max_tokens-10e400", "surrogate-prompt", "surrogate-content",
        "role-object"])
def test_hostile_body_is_400_not_500(keyed, path, raw, param, unsubmitted):
    r = keyed.simulate_post(path, body=raw,
                            headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json["error"]
    assert error["type"] == "invalid_request_error"
    assert error.get("param") == param


def test_unknown_route_and_method(keyed):
    assert keyed.simulate_get("/v1/nothing", headers=AUTH).status_code == 404
    r = keyed.simulate_get("/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json


@pytest.mark.parametrize("body, param, needle", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["a", ""]}, "input", "'input'[1] must not be empty"),
    ({"input": [[]]}, "input", "'input'[0] must not be empty"),
    ({"input": 5}, "input", "must be a string"),
    # llama-server's one input of ids and text (issue 34, item 11): refused.
    ({"input": ["a", 5]}, "input", "'input' mixes token ids and text"),
    ({"input": [1, "a"]}, "input", "'input' mixes token ids and text"),
    ({"input": [[1, "a"]]}, "input", "'input'[0] mixes token ids and text"),
    ({"input": [{"prompt": "a"}]}, "input", "unknown key 'prompt'"),
    ({"input": [True]}, "input", "must be a string"),
    ({"input": [1, 2**70]}, "input[1]", "is an integer out of range"),
    ({"input": [1, 2**40]}, "input", "'input' has a token id out of range"),
    ({"input": [[1], [-1]]}, "input", "'input'[1] has a token id out of range"),
    ({}, "input", "\"input\" or \"content\" must be provided"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "a", "dimensions": 0}, "dimensions", "positive"),
    ({"input": "a", "embd_normalize": "2"}, "embd_normalize", "integer"),
    ({"input": "a", "temperature": 0.5}, "temperature", "not supported"),
    ({"input": ["a"] * 2049}, "input", "at most 2048"),
])
def test_bad_embeddings_input_gets_400_naming_the_field(open_client, inproc_pool,
                                                        body, param, needle):
    """Moved from ``tests/test_embeddings.py``: refused at the door, so the
    frontend alone decides it (the workers' own refusals stay there)."""
    before = inproc_pool.status()["counters"].get("finished", 0)
    r = open_client.simulate_post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json["error"]
    assert error["param"] == param and needle in error["message"]
    assert error["type"] == "invalid_request_error"
    assert inproc_pool.status()["counters"].get("finished", 0) == before


# --- headers ------------------------------------------------------------------------


def test_a_well_formed_request_id_is_kept_and_another_replaced(open_client):
    r = open_client.simulate_get("/health", headers={"X-Request-Id": "abc-123.x"})
    assert r.headers["X-Request-Id"] == "abc-123.x"
    r = open_client.simulate_get("/health", headers={"X-Request-Id": "bad id\twith"})
    assert r.headers["X-Request-Id"] != "bad id\twith"
    assert len(r.headers["X-Request-Id"]) == 32


def test_a_generation_names_its_slot_and_request(open_client, inproc_pool):
    r = open_client.simulate_post("/v1/completions",
                                  json={"prompt": "Hi", "max_tokens": 3},
                                  headers={"X-Request-Id": "req-7"})
    assert r.status_code == 200, r.text
    slots = {s["id"] for s in inproc_pool.status()["slots"]}
    assert int(r.headers["X-Slot-Id"]) in slots
    assert r.headers["X-Request-Id"] == "req-7"
    assert r.json["choices"][0]["text"] == "tok0 tok1 tok2"
    assert r.json["usage"]["completion_tokens"] == 3
    inproc_pool.assert_whole()


# --- the SSE stream's shape -------------------------------------------------------


def stream(client, path: str, body: dict) -> list:
    r = client.simulate_post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(r.text)


def test_a_streamed_completion_is_chunks_then_done(open_client, inproc_pool):
    events = stream(open_client, "/v1/completions", {
        "prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "tok0 tok1 tok2 tok3"
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert len({c["id"] for c in events[:-1]}) == 1
    inproc_pool.assert_whole()


def test_a_streamed_chat_names_the_role_first_and_only_once(open_client):
    events = stream(open_client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert events[-1] == "[DONE]"
    first, *rest = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0,
                                 "delta": {"role": "assistant", "content": None},
                                 "logprobs": None, "finish_reason": None}]
    assert all("role" not in e["choices"][0]["delta"] for e in rest)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in rest)
    assert text == "tok0 tok1 tok2"
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stream_with_no_text_still_names_the_role_first(open_client):
    """Moved from ``tests/test_llama_details.py`` (which keeps the role-only
    first chunk through real processes)."""
    events = stream(open_client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant",
                                                "content": None}
    assert events[1]["choices"][0]["finish_reason"] == "length"


def test_an_unstreamed_chat_is_one_message(open_client):
    r = open_client.simulate_post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = json.loads(r.text)
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "tok0 tok1"}
    assert choice["finish_reason"] == "length"
