"""Rerank's pieces in process: the wire field, the worker's checks and its
join of query and document, the frontend's parser and answer.

``tests/test_rerank.py`` runs the whole path through real processes.
"""

from __future__ import annotations

import json

import llama_cpp
import pytest

from frontend.errors import BadRequest
from frontend.rerank_api import parse_rerank, shape_response
from llamapool.test_model import write_test_model
from llamapool.test_reranker import RERANK_TEMPLATE, write_test_reranker
from protocol.errors import ErrorCode
from protocol.payloads import EMBEDDING, EmbeddingInput, GenerationRequest
from workers.model.embedding import Embedder
from workers.model.engine import RequestRejected
from workers.model.features import ALL_FEATURES, refuse_unsupported
from workers.model.prompting import PromptBuilder
from workers.model.rerank import SequenceFormat, fill, rank_job


def test_rerank_query_survives_the_wire():
    request = GenerationRequest(kind=EMBEDDING, inputs=[EmbeddingInput(text="d")],
                                rerank_query="q")
    assert GenerationRequest.from_body(request.to_body()).rerank_query == "q"
    plain = GenerationRequest(kind=EMBEDDING)
    assert GenerationRequest.from_body(plain.to_body()).rerank_query is None


def test_a_rerank_query_on_a_generation_is_refused_not_ignored():
    with pytest.raises(RequestRejected) as refused:
        refuse_unsupported(GenerationRequest("completion", "Hi", rerank_query="q"),
                           "llama.cpp", ALL_FEATURES)
    assert refused.value.code == ErrorCode.UNSUPPORTED_FIELD
    assert "rerank_query" in str(refused.value)


def test_fill_is_one_pass():
    """A query that contains ``{document}`` stays as written."""
    assert fill("Q={query} D={document}", "a {document} b", "doc") == (
        "Q=a {document} b D=doc")


def test_parse_defaults_and_shapes():
    parsed = parse_rerank({"query": "q", "documents": ["a", {"text": "b"}]})
    assert parsed.documents == ["a", "b"] and parsed.top_n == 2
    assert not parsed.return_documents and not parsed.tei
    assert parsed.generation.rerank_query == "q"
    assert [i.text for i in parsed.generation.inputs] == ["a", "b"]
    # An empty query and document are what llama-server takes too.
    assert parse_rerank({"query": "", "documents": [""]}).documents == [""]


def test_parse_refuses_unknown_fields():
    with pytest.raises(BadRequest) as refused:
        parse_rerank({"query": "q", "documents": ["a"], "max_chunks_per_doc": 2})
    assert "max_chunks_per_doc" in str(refused.value)


def test_answer_is_best_first_stable_and_cut_to_top_n():
    parsed = parse_rerank({"query": "q", "documents": ["a", "b", "c", "d"],
                           "top_n": 3, "return_documents": True})
    body = json.loads(shape_response(parsed, [0.1, 0.5, 0.1, 0.9], "m", 12))
    assert [r["index"] for r in body["results"]] == [3, 1, 0]
    assert body["results"][0] == {"index": 3, "relevance_score": 0.9,
                                  "document": {"text": "d"}}
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    assert body["model"] == "m" and body["object"] == "list"
    tei = parse_rerank({"query": "q", "texts": ["a", "b"]})
    assert json.loads(shape_response(tei, [0.2, 0.3], "m", 4)) == [
        {"index": 1, "score": 0.3}, {"index": 0, "score": 0.2}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    where = tmp_path_factory.mktemp("rerank-unit")
    # F32 (no --quant): loaded in this process, where no repack switch
    # applies (``workers.model.weight_repack``).
    paths = {"template": where / "t.gguf", "plain": where / "p.gguf",
             "chat": where / "c.gguf"}
    write_test_reranker(paths["template"])
    write_test_reranker(paths["plain"], rerank_template=False)
    write_test_model(paths["chat"])
    return paths


def embedder_of(path) -> Embedder:
    llama = llama_cpp.Llama(str(path), n_ctx=256, verbose=False)
    return Embedder(llama, PromptBuilder(llama, None), n_threads=1)


def test_the_join_follows_llama_cpp(models):
    """With the template: filled in, specials parsed, nothing added; plain:
    BOS query document (the tiny vocabulary adds BOS only)."""
    embedder = embedder_of(models["template"])
    fmt = SequenceFormat(embedder)
    assert fmt.template == RERANK_TEMPLATE
    [seq] = fmt.sequences("hi", ["the cat"], lambda: False)
    llama = embedder.llama
    assert seq == llama.tokenize(
        fill(RERANK_TEMPLATE, "hi", "the cat").encode(), add_bos=False,
        special=True)
    plain = SequenceFormat(embedder_of(models["plain"]))
    assert plain.template is None and plain.eos == [] and plain.sep == []
    [seq] = plain.sequences("hi", ["the cat"], lambda: False)
    assert seq == (llama.tokenize(b"hi", add_bos=True, special=False)
                   + llama.tokenize(b"the cat", add_bos=False, special=False))


class _Sink:
    def should_stop(self) -> bool:
        return False


def test_worker_refusals(models):
    chat = embedder_of(models["chat"])
    job = GenerationRequest(kind=EMBEDDING, inputs=[EmbeddingInput(text="d")],
                            rerank_query="q")
    assert not chat.ranks
    with pytest.raises(RequestRejected, match="does not rerank"):
        rank_job(chat, job, _Sink())
    ranker = embedder_of(models["plain"])
    ids = GenerationRequest(kind=EMBEDDING, inputs=[EmbeddingInput(tokens=[5])],
                            rerank_query="q")
    with pytest.raises(RequestRejected, match="token ids"):
        rank_job(ranker, ids, _Sink())
    no_bos = SequenceFormat(ranker)
    no_bos.bos = []  # as a vocabulary that adds no BOS
    with pytest.raises(RequestRejected, match="both empty"):
        no_bos.sequences("", [""], lambda: False)
