"""llama-server parity, second round, item 11 (issue 34): the small fields,
each implemented or refused with a 400 naming it, through real gunicorn, a
real broker and workers on the tiny GGUF.

Implemented: ``response_fields`` (llama.cpp's ``json_get_nested_values`` on
the final answer), ``verbose`` (accepted: llama.cpp's native answer is the
same with it and already echoes the rendered ``prompt``), embedding inputs
as ``{"prompt_string": ...}`` and ``{"content": [text parts]}``. Refused:
a mix of ids and text in one embedding input, media, ``return_progress``,
``post_sampling_probs``, ``n`` > 1.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pool import sse_events

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
TEXT = "Hello world, how are you?"
GREEDY = {"temperature": 0, "seed": 3, "ignore_eos": True}


def _post(pool, path: str, body: dict) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=TIMEOUT_S)


def _refused(r: httpx.Response, name: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert name in error["message"], error


def test_response_fields_keep_and_unnest_as_llama_server(whole_pool):
    body = {"prompt": TEXT, "n_predict": 3, **GREEDY}
    whole = _post(whole_pool, "/completion", body).json()
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n",
              "no_such_field", "content/not_an_object"]
    r = _post(whole_pool, "/completion", {**body, "response_fields": fields})
    assert r.status_code == 200, r.text
    assert r.json() == {"content": whole["content"],
                        "generation_settings/n_predict": 3,
                        "timings/predicted_n": 3}
    # Streamed: the chunks whole, the final one filtered.
    with httpx.stream("POST", whole_pool.url + "/completion",
                      json={**body, "stream": True, "response_fields": ["stop"]},
                      timeout=TIMEOUT_S) as s:
        *chunks, last = sse_events(s.iter_lines())
    assert last == {"stop": True}
    assert chunks and all("content" in c for c in chunks)
    _refused(_post(whole_pool, "/completion", {**body, "response_fields": "x"}),
             "response_fields")


def test_verbose_is_accepted_and_the_prompt_is_echoed(whole_pool):
    out = _post(whole_pool, "/completion",
                {"prompt": TEXT, "n_predict": 1, "verbose": True}).json()
    assert out["prompt"].endswith(TEXT)
    _refused(_post(whole_pool, "/completion",
                   {"prompt": TEXT, "n_predict": 1, "verbose": "yes"}), "verbose")


def test_embedding_inputs_as_objects_equal_the_text(whole_pool):
    def vectors(inputs) -> list:
        r = _post(whole_pool, "/v1/embeddings", {"input": inputs})
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    by_text = vectors(["Hello world", "bye"])
    as_objects = vectors([{"prompt_string": "Hello world"},
                          {"content": [{"type": "text", "text": "b"},
                                       {"type": "text", "text": "ye"}]}])
    for a, b in zip(by_text, as_objects, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    native = _post(whole_pool, "/embeddings",
                   {"content": {"prompt_string": "bye"}}).json()
    assert len(native) == 1 and native[0]["embedding"]


@pytest.mark.parametrize("inputs,named", [
    ([1, 2, "text"], "mixes token ids and text"),
    ({"prompt_string": "x", "multimodal_data": ["AAAA"]}, "multimodal_data"),
    ({"content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "image_url"),
    ({"prompt": "x"}, "unknown key 'prompt'"),
])
def test_embedding_inputs_the_pool_cannot_embed_are_refused(whole_pool, inputs,
                                                              named):
    _refused(_post(whole_pool, "/v1/embeddings", {"input": inputs}), named)


@pytest.mark.parametrize("path,body,named", [
    ("/completion", {"prompt": TEXT, "return_progress": True}, "return_progress"),
    ("/completion", {"prompt": TEXT, "post_sampling_probs": True},
     "post_sampling_probs"),
    ("/v1/completions", {"prompt": TEXT, "n": 2}, "n=1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "n": 3}, "n=1"),
])
def test_fields_the_pool_does_not_offer_are_refused_naming_them(whole_pool, path,
                                                                body, named):
    r = _post(whole_pool, path, {**body, "max_tokens": 1})
    _refused(r, named)
    assert r.json()["error"]["param"] == named.removesuffix("=1")
