"""``/v1/embeddings`` and ``/embeddings`` through real processes.

The tiny random-weight model checks shapes, encodings, normalisation, order,
token-id input and every refusal; one short test runs the default Gemma 3
270M model, whose GGUF has no pooling type of its own (llama.cpp's server
refuses ``/v1/embeddings`` for it; here it is mean-pooled).
"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import llama_cpp
import openai
import pytest

from tests.pool import wait_until
from tests.test_slot_paths import LONG, RawStream, wait_paused

pytestmark = pytest.mark.stack

TEXTS = ["The cat sat on the mat.", "Quantum chromodynamics", "hello",
         "The cat sat on the mat."]


@pytest.fixture
def client(whole_pool):
    return openai.OpenAI(base_url=whole_pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def post(pool, path: str, body) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=60)


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_openai_client_default_base64(client, whole_pool):
    """The openai client asks for base64 by default and decodes it itself."""
    out = client.embeddings.create(model="anything", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2, 3]
    vectors = [d.embedding for d in out.data]
    assert {len(v) for v in vectors} == {64}  # the tiny model's n_embd
    for v in vectors:
        assert abs(norm(v) - 1.0) < 1e-4
    assert close(vectors[0], vectors[3])  # identical inputs, identical vectors
    assert not close(vectors[0], vectors[1])
    assert not close(vectors[1], vectors[2])
    assert out.usage.prompt_tokens > len(TEXTS)
    assert out.usage.total_tokens == out.usage.prompt_tokens
    assert out.model == "tiny.gguf"
    # float and base64 carry the same numbers (base64: little-endian float32).
    as_float = client.embeddings.create(model="x", input=TEXTS,
                                        encoding_format="float")
    for a, b in zip(as_float.data, out.data):
        assert a.embedding == b.embedding


def test_raw_shapes_and_base64_equals_float(whole_pool):
    floats = post(whole_pool, "/v1/embeddings",
                  {"input": TEXTS[:2], "encoding_format": "float"})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list"
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    assert [(d["object"], d["index"]) for d in body["data"]] == [
        ("embedding", 0), ("embedding", 1)]
    b64 = post(whole_pool, "/v1/embeddings",
               {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, b in zip(body["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]


def test_batch_order_is_preserved(whole_pool):
    """Each vector belongs to its input, whatever the batch around it."""
    alone = [post(whole_pool, "/v1/embeddings", {"input": t}).json()["data"][0]
             ["embedding"] for t in TEXTS[:3]]
    batch = post(whole_pool, "/v1/embeddings",
                 {"input": list(reversed(TEXTS[:3]))}).json()["data"]
    for i, item in enumerate(batch):
        assert item["index"] == i
        assert close(item["embedding"], alone[2 - i])


def test_largest_batch_flows_under_credit(whole_pool):
    """2048 inputs (the limit): a SUBMIT the broker accepts, and eight times
    the worker's credit window of frames, all in order."""
    texts = [f"word number {i}" for i in range(2048)]
    r = post(whole_pool, "/v1/embeddings", {"input": texts,
                                            "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(2048))
    last = post(whole_pool, "/v1/embeddings", {"input": texts[-1],
                                               "encoding_format": "base64"})
    assert data[-1]["embedding"] == last.json()["data"][0]["embedding"]


def test_token_ids_equal_text(whole_pool, tiny_model):
    """Token-id input gives the text's vector once tokenised as llama.cpp's
    server tokenises embedding input (BOS added, special tokens parsed)."""
    vocab = llama_cpp.Llama(model_path=str(tiny_model), vocab_only=True,
                            verbose=False)
    ids = [vocab.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS[:2]]
    by_text = post(whole_pool, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    by_ids = post(whole_pool, "/v1/embeddings", {"input": ids}).json()
    one_list = post(whole_pool, "/v1/embeddings", {"input": ids[0]}).json()
    assert by_ids["usage"] == by_text["usage"]
    for t, i in zip(by_text["data"], by_ids["data"]):
        assert close(t["embedding"], i["embedding"])
    assert close(one_list["data"][0]["embedding"], by_text["data"][0]["embedding"])


def test_native_endpoint_shape(whole_pool):
    """llama.cpp's native shape: a list of {index, embedding: [vector]}."""
    oai = post(whole_pool, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    for path, body in (("/embeddings", {"input": TEXTS[:2]}),
                       ("/embedding", {"content": TEXTS[:2]}),
                       # "content" on /v1 selects the native shape, as in llama.cpp
                       ("/v1/embeddings", {"content": TEXTS[:2]})):
        r = post(whole_pool, path, body)
        assert r.status_code == 200, (path, r.text)
        items = r.json()
        assert [sorted(i) for i in items] == [["embedding", "index"]] * 2
        assert [i["index"] for i in items] == [0, 1]
        for item, ref in zip(items, oai["data"]):
            assert len(item["embedding"]) == 1
            assert close(item["embedding"][0], ref["embedding"])


def test_embd_normalize(whole_pool):
    raw = post(whole_pool, "/embeddings",
               {"input": "hello", "embd_normalize": -1}).json()[0]["embedding"][0]
    unit = post(whole_pool, "/embeddings",
                {"input": "hello"}).json()[0]["embedding"][0]
    assert abs(norm(raw) - 1.0) > 1e-3  # really unnormalised
    assert close([x / norm(raw) for x in raw], unit, 1e-4)
    taxicab = post(whole_pool, "/embeddings",
                   {"input": "hello", "embd_normalize": 1}).json()[0]["embedding"][0]
    assert abs(sum(abs(x) for x in taxicab) - 1.0) < 1e-4


# Bodies refused at the door (400 naming the field, no job): in process, in
# tests/test_frontend_inproc.py. The workers' own refusals:


@pytest.mark.parametrize("body, needle", [
    # The tiny model's vectors have 64 dimensions; they are never truncated.
    ({"input": "a", "dimensions": 32}, "'dimensions' is not supported"),
    ({"input": "hello " * 600},
     "tokens) is too large to process. increase the physical batch size "
     "(current batch size: 512)"),
    ({"input": [[1, 2, 10**9]]}, "token ids must be in the vocabulary"),
    # Quadratic for llama.cpp's own tokeniser (minutes); refused by its size
    # here, with bounded work (workers.model.tokenizing).
    ({"input": "<s>" * 100_000}, "input[0]: input (at least"),
])
def test_worker_refusals_are_400s(whole_pool, body, needle):
    r = post(whole_pool, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_dimensions_equal_to_the_model_is_accepted(whole_pool):
    r = post(whole_pool, "/v1/embeddings", {"input": "a", "dimensions": 64})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


def test_full_pool_answers_503_with_retry_after(whole_pool):
    """An embedding job takes a slot like any job: none free, 503."""
    streams = [RawStream(whole_pool.port, LONG) for _ in range(2)]
    try:
        for s in streams:
            wait_paused(whole_pool, int(s.header("X-Slot-Id")))
        for path in ("/v1/embeddings", "/embeddings"):
            r = post(whole_pool, path, {"input": "hello"})
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "unavailable_error"
    finally:
        for s in streams:
            s.close()
    whole_pool.assert_whole()


def test_prompt_tokens_are_counted(whole_pool):
    def prompt_total() -> float:
        text = httpx.get(whole_pool.url + "/metrics", timeout=30).text
        line = next(ln for ln in text.splitlines()
                    # The pool's one model (its file's name) labels it.
                    if ln.startswith('llama_prompt_tokens_total{model="tiny.gguf"} '))
        return float(line.split()[1])

    before = prompt_total()
    out = post(whole_pool, "/v1/embeddings", {"input": TEXTS}).json()
    n = out["usage"]["prompt_tokens"]
    wait_until(lambda: prompt_total() - before == n, 30,
               f"llama_prompt_tokens_total to grow by {n}")


@pytest.fixture(scope="module")
def gemma_pool(pool_factory):
    from llamapool.supervisor import default_model_path

    # One worker, so every request below meets the same KV cache; a small
    # embedding batch, to check the flag reaches the worker.
    with pool_factory(model=default_model_path(), workers=1,
                      worker_args=("--embedding-batch", "64")) as p:
        yield p


def test_default_gemma_model(gemma_pool):
    """Gemma 3 270M (no pooling type in its GGUF) gives unit vectors in which
    similar sentences are closer than unrelated ones."""
    client = openai.OpenAI(base_url=gemma_pool.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    out = client.embeddings.create(model="gemma", input=[
        "The cat sits on the mat.", "A cat is sitting on a mat.",
        "Stock markets fell sharply on Tuesday."])
    a, b, c = (d.embedding for d in out.data)
    assert len(a) == 640  # Gemma 3 270M's hidden size
    for v in (a, b, c):
        assert abs(norm(v) - 1.0) < 1e-4

    def cos(x, y):
        return sum(p * q for p, q in zip(x, y))

    assert cos(a, b) > cos(a, c)
    r = post(gemma_pool, "/v1/embeddings", {"input": "word " * 80})
    assert r.status_code == 400
    assert "(current batch size: 64)" in r.json()["error"]["message"]
    gemma_pool.assert_whole()


def test_embedding_keeps_the_generation_cache(gemma_pool):
    """An embedding runs in its own context: the next turn of a conversation
    still finds its prefix in the worker's KV cache."""
    prompt = "Once upon a time, in a small village by the sea, there lived " * 3

    def cached() -> int:
        r = post(gemma_pool, "/v1/completions",
                 {"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert post(gemma_pool, "/v1/embeddings",
                {"input": "something else entirely"}).status_code == 200
    assert cached() > 20
    gemma_pool.assert_whole()
