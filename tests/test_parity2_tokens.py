"""llama-server parity, second round, bug 2 (issue 34): every streamed
``/completion`` chunk carries the ids of the tokens it covers, asked for or
not, as llama-server's ``send_partial_response`` sends them. They came as
``tokens: []`` unless ``return_tokens`` was set. Through real gunicorn, a
real broker and workers on the tiny GGUF.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pool import sse_events
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
TEXT = "Hello world, how are you? I am a test model."
GREEDY = {"temperature": 0, "seed": 3, "ignore_eos": True}

#: A worker of two slots decoded as one batch (``--slots 2``): its own
#: output path (``workers.model.batch_slots``).
batched_pool = pool_fixture(workers=1, slots_per_worker=2)


def _post(pool, path: str, body: dict) -> dict:
    r = httpx.post(pool.url + path, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(pool, body: dict) -> list[dict]:
    with httpx.stream("POST", pool.url + "/completion",
                      json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_every_streamed_chunk_carries_its_token_ids(whole_pool):
    body = {"prompt": TEXT, "n_predict": 12, **GREEDY}
    whole = _post(whole_pool, "/completion", {**body, "return_tokens": True})
    events = _stream(whole_pool, body)  # no return_tokens
    *chunks, last = events
    assert chunks and all(c["tokens"] for c in chunks)
    # Each chunk's ids are the tokens it adds to tokens_predicted.
    predicted = 0
    for chunk in chunks:
        predicted += len(chunk["tokens"])
        assert chunk["tokens_predicted"] == predicted
    ids = [t for e in events for t in e["tokens"]]
    assert len(ids) == last["tokens_predicted"] == 12
    assert ids == whole["tokens"]
    text = _post(whole_pool, "/detokenize", {"tokens": ids})["content"]
    assert text == "".join(e["content"] for e in events) == whole["content"]


def test_a_stop_strings_tokens_are_streamed_too(whole_pool):
    """As llama-server: the tokens of the stop string count and are sent
    (their text is not), so the ids add up to ``tokens_predicted``."""
    body = {"prompt": TEXT, "n_predict": 12, **GREEDY}
    greedy = _post(whole_pool, "/completion", {**body, "return_tokens": True})
    stop = _post(whole_pool, "/detokenize",
                 {"tokens": greedy["tokens"][5:7]})["content"].strip()
    assert stop, "the tiny model's tokens 5-6 have text"
    events = _stream(whole_pool, {**body, "stop": [stop]})
    last = events[-1]
    assert last["stop_type"] == "word" and last["stopping_word"] == stop
    ids = [t for e in events for t in e["tokens"]]
    assert len(ids) == last["tokens_predicted"] <= 7
    assert ids == greedy["tokens"][:len(ids)]
    assert stop not in "".join(e["content"] for e in events)


def test_a_batched_worker_streams_token_ids_too(batched_pool):
    body = {"prompt": TEXT, "n_predict": 8, **GREEDY}
    events = _stream(batched_pool, body)
    ids = [t for e in events for t in e["tokens"]]
    assert len(ids) == events[-1]["tokens_predicted"] == 8
    text = _post(batched_pool, "/detokenize", {"tokens": ids})["content"]
    assert text == "".join(e["content"] for e in events)
