"""``/rerank``, ``/reranking``, ``/v1/rerank`` through real processes.

Two pools: ``chat`` (the plain tiny model, no rank head) beside ``ranker``
(``make-test-model --reranker``: a tiny Qwen3 with a rank head and a
``rerank`` template); and two rerankers, ``ranker`` and ``plain`` (no
template: llama.cpp's BOS query document layout). The scores are checked
against llama.cpp run in this process on the same file, with the query and
document joined here as llama.cpp's server joins them, so a wrong join, a
wrong head or a wrong order fails.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import llama_cpp
import pytest

from llamapool.test_reranker import RERANK_TEMPLATE
from tests.test_many_models import MixedPool, make_model

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
QUERY = "what is a test"
DOCS = ["hello world", "the cat", "good day", "a test of the model",
        "why not say yes"]
PATHS = ("/rerank", "/reranking", "/v1/rerank")


def make_reranker(path, *extra: str):
    # F32: the in-process reference then runs the same kernels as the
    # worker with no repack switch to match (``workers.model.weight_repack``).
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    str(path), "--reranker", *extra], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    where = tmp_path_factory.mktemp("rerank-models")
    return {"chat": make_model(where / "chat.gguf"),
            "ranker": make_reranker(where / "ranker.gguf"),
            "plain": make_reranker(where / "plain.gguf", "plain")}


@pytest.fixture(scope="module")
def mixed(files, tmp_path_factory):
    pool = MixedPool(tmp_path_factory.mktemp("rerank-mixed"), [
        ("chat", files["chat"], (), 0), ("ranker", files["ranker"], (), 0)])
    yield pool
    pool.stop()


def reference(path, query: str, docs: list[str], template: bool
              ) -> tuple[list[float], int]:
    """Each document's score by llama.cpp in process (rank pooling, the
    head's first output, as ``send_rerank``), and the tokens in all."""
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512,
                          n_ubatch=512, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK)
    scores, total = [], 0
    for doc in docs:
        if template:
            prompt = RERANK_TEMPLATE.replace("{query}", query).replace(
                "{document}", doc)
            tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        else:  # add_bos yes, add_eos and add_sep no: BOS query doc
            tokens = (llm.tokenize(query.encode(), add_bos=True, special=False)
                      + llm.tokenize(doc.encode(), add_bos=False, special=False))
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, True)
        llm._ctx.decode(llm._batch)
        scores.append(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0])
        total += len(tokens)
    llm.close()
    return scores, total


def ranked(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def post(pool, path: str, body) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def expected(files):
    scores, total = reference(files["ranker"], QUERY, DOCS, template=True)
    order = ranked(scores)
    # The test's own premise: distinct scores, so the order means something.
    gaps = [scores[a] - scores[b] for a, b in zip(order, order[1:])]
    assert min(gaps) > 1e-4, scores
    return scores, total


def test_every_path_ranks_as_llama_cpp_does(mixed, expected):
    scores, total = expected
    for path in PATHS:
        resp = post(mixed, path, {"model": "ranker", "query": QUERY,
                                  "documents": DOCS})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "list" and body["model"] == "ranker"
        assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
        results = body["results"]
        assert [r["index"] for r in results] == ranked(scores)
        for r in results:
            assert set(r) == {"index", "relevance_score"}
            assert abs(r["relevance_score"] - scores[r["index"]]) < 1e-3


def test_top_n_and_return_documents_in_jina_and_cohere_shapes(mixed, expected):
    scores, _ = expected
    best = ranked(scores)
    as_objects = [{"text": d} for d in DOCS]  # Jina's and Cohere's objects
    for documents in (DOCS, as_objects):
        resp = post(mixed, "/v1/rerank", {
            "model": "ranker", "query": QUERY, "documents": documents,
            "top_n": 2, "return_documents": True})
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert [r["index"] for r in results] == best[:2]
        assert [r["document"] for r in results] == [{"text": DOCS[i]}
                                                    for i in best[:2]]
    # More than there are: all of them.
    resp = post(mixed, "/rerank", {"model": "ranker", "query": QUERY,
                                   "documents": DOCS, "top_n": 99})
    assert len(resp.json()["results"]) == len(DOCS)


def test_tei_form_is_a_bare_list_with_score_and_text(mixed, expected):
    scores, _ = expected
    resp = post(mixed, "/rerank", {"model": "ranker", "query": QUERY,
                                   "texts": DOCS, "return_text": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [r["index"] for r in body] == ranked(scores)
    assert all(set(r) == {"index", "score", "text"} for r in body)
    assert all(r["text"] == DOCS[r["index"]] for r in body)


def test_no_model_goes_to_the_only_reranker(mixed, expected):
    resp = post(mixed, "/rerank", {"query": QUERY, "documents": DOCS[:2]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "ranker"


def test_a_model_without_a_rank_head_is_400_and_takes_no_slot(mixed):
    before = mixed.status()["counters"].get("submitted", 0)
    resp = post(mixed, "/v1/rerank", {"model": "chat", "query": QUERY,
                                      "documents": DOCS})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "model" and "does not rerank" in error["message"]
    assert "ranker" in error["message"]
    assert mixed.status()["counters"].get("submitted", 0) == before


def test_models_say_which_rerank(mixed):
    data = httpx.get(mixed.url + "/v1/models", timeout=TIMEOUT_S).json()["data"]
    caps = {m["id"]: m["capabilities"] for m in data}
    assert "rerank" in caps["ranker"]
    assert "rerank" not in caps["chat"]
    # The reranker is still a causal LM: it generates, too.
    gen = post(mixed, "/v1/completions", {"model": "ranker", "prompt": "Hi",
                                          "max_tokens": 2})
    assert gen.status_code == 200, gen.text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"documents": DOCS}, "query", "must be provided"),
    ({"query": 3, "documents": DOCS}, "query", "must be a string"),
    ({"query": QUERY}, "documents", "non-empty string array"),
    ({"query": QUERY, "documents": []}, "documents", "non-empty"),
    ({"query": QUERY, "documents": "one"}, "documents", "non-empty"),
    ({"query": QUERY, "documents": ["a", 3]}, "documents", "documents[1]"),
    ({"query": QUERY, "documents": [{"txt": "a"}]}, "documents", "documents[0]"),
    ({"query": QUERY, "documents": ["a"] * 2049}, "documents", "at most 2048"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n", "positive"),
    ({"query": QUERY, "documents": DOCS, "top_n": True}, "top_n", "positive"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n", "positive"),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"},
     "return_documents", "boolean"),
    ({"query": QUERY, "documents": DOCS, "return_text": True},
     "return_text", "'return_documents'"),
    ({"query": QUERY, "documents": DOCS, "texts": DOCS}, "texts", "not both"),
    ({"query": QUERY, "documents": DOCS, "rank_fields": ["x"]}, "rank_fields",
     "rank_fields"),
    ({"query": QUERY, "documents": DOCS, "model": 5}, "model", "string"),
])
def test_bad_requests_are_400_naming_the_field(mixed, body, param, words):
    resp = post(mixed, "/rerank", {"model": "ranker", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error.get("param") == param or param in error["message"], error
    assert words in error["message"], error


def test_a_document_too_long_is_400_from_the_worker(mixed):
    resp = post(mixed, "/rerank", {"model": "ranker", "query": QUERY,
                                   "documents": ["ok", "hello " * 600]})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "documents[1]" in message and "too large" in message


@pytest.fixture(scope="module")
def rerankers(files, tmp_path_factory):
    pool = MixedPool(tmp_path_factory.mktemp("rerank-two"), [
        ("ranker", files["ranker"], (), 0), ("plain", files["plain"], (), 0)])
    yield pool
    pool.stop()


def test_plain_layout_without_a_template(rerankers, files):
    scores, total = reference(files["plain"], QUERY, DOCS, template=False)
    resp = post(rerankers, "/v1/rerank", {"model": "plain", "query": QUERY,
                                          "documents": DOCS})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == total
    assert [r["index"] for r in body["results"]] == ranked(scores)
    for r in body["results"]:
        assert abs(r["relevance_score"] - scores[r["index"]]) < 1e-3


def test_several_rerankers_and_no_model_is_400(rerankers):
    resp = post(rerankers, "/rerank", {"query": QUERY, "documents": DOCS})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "model"


def test_a_pool_without_a_reranker_is_400(whole_pool):
    resp = post(whole_pool, "/rerank", {"query": QUERY, "documents": DOCS})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "model" and "reranks" in error["message"]


def test_a_batched_worker_reranks_too(pool_factory, files, expected):
    """A worker of several slots (``workers.model.batched_worker``) runs a
    rerank job on its embedding context, as the one-slot worker does."""
    scores, total = expected
    with pool_factory(model=files["ranker"], workers=1, slots_per_worker=2) as pool:
        resp = post(pool, "/reranking", {"query": QUERY, "documents": DOCS})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens"] == total
        assert [r["index"] for r in body["results"]] == ranked(scores)
