"""``POST /rerank`` (and ``/reranking``, ``/v1/rerank``, ``/v1/reranking``).

llama-server's rerank endpoint, which follows Jina's API: a ``query`` and
``documents``, answered with each document's relevance score, best first::

    {"model": ..., "object": "list",
     "usage": {"prompt_tokens": n, "total_tokens": n},
     "results": [{"index": i, "relevance_score": s, "document"?: ...}]}

A rerank is a job like an embedding (it takes a slot, so the 503 +
Retry-After rule holds): the worker joins the query with each document as
llama.cpp's server does and scores the sequence with its model's rank head
(``workers.model.rerank``), one TOKEN frame per document.

Request:

* ``query``: a string. ``documents``: a non-empty list (at most
  ``MAX_EMBEDDING_INPUTS``) of strings, or Jina's and Cohere's objects
  ``{"text": ...}`` (llama-server takes strings only).
* ``top_n``: a positive integer; the best ``top_n`` results (default all).
* ``return_documents`` (Jina, Cohere): each result also carries its
  document, as ``{"text": ...}`` (Jina's and Cohere's shape). llama-server
  has no such field; the default, false, answers as it does.
* llama-server's TEI form: ``texts`` in place of ``documents`` answers
  Hugging Face TEI's shape, a bare list of ``{"index", "score", "text"?}``,
  with ``return_text`` for the text.
* ``model``: as for any job (``frontend.model_resolution``), with one
  difference: with no ``model`` and exactly one model of the pool that
  reranks, that one is used (a pool of a chat model and a reranker needs no
  name). A model that does not rerank is a 400 naming ``model``, and so is
  a pool with no reranker at all; ``/v1/models`` lists ``rerank`` among the
  capabilities of a model that does.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import falcon

from frontend import request_fields
from frontend.embeddings import collect_vectors
from frontend.endpoint import JobEndpoint, Submission
from frontend.errors import BadRequest, UpstreamError
from frontend.field_policy import FieldPolicy
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.request_fields import RequestFields
from frontend.settings import FrontendSettings
from protocol.errors import ErrorCode
from protocol.limits import MAX_EMBEDDING_INPUTS
from protocol.payloads import EMBEDDING, EmbeddingInput, GenerationRequest

#: The routes: llama-server's four names for it.
PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")

#: Every field is read; nothing is accepted unread.
RERANK = FieldPolicy(frozenset())

#: The capability a model's workers announce (``workers.model.capabilities``).
CAPABILITY = "rerank"


def _document(value: object, param: str, i: int) -> str:
    """A document: a string, or ``{"text": string}`` (Jina, Cohere)."""
    if isinstance(value, dict) and set(value) == {"text"}:
        value = value["text"]
    if not isinstance(value, str):
        raise BadRequest(f"'{param}[{i}]' must be a string or {{\"text\": "
                         "string}", param=param)
    return value


def _flag(fields: RequestFields, name: str) -> bool:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return bool(value)


@dataclasses.dataclass(frozen=True)
class RerankRequest:
    """A validated rerank body: the job (``generation``), and how to answer."""

    generation: GenerationRequest
    documents: list[str]
    top_n: int
    return_documents: bool
    #: llama-server's TEI form (``texts``): a bare list, ``score``.
    tei: bool
    model: str | None


def parse_rerank(body: object) -> RerankRequest:
    """The body, checked: a 400 naming the first bad field."""
    fields = RequestFields(body)
    query = fields.get("query")
    if query is None:
        raise BadRequest("\"query\" must be provided", param="query")
    if not isinstance(query, str):
        raise BadRequest("\"query\" must be a string", param="query")
    tei = fields.get("texts") is not None
    param = "texts" if tei else "documents"
    raw = fields.get(param)
    if tei and fields.get("documents") is not None:
        raise BadRequest("give 'documents' or 'texts', not both", param="texts")
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"\"{param}\" must be a non-empty string array",
                         param=param)
    if len(raw) > MAX_EMBEDDING_INPUTS:
        raise BadRequest(f"'{param}' has {len(raw)} documents; at most "
                         f"{MAX_EMBEDDING_INPUTS}", param=param)
    documents = [_document(item, param, i) for i, item in enumerate(raw)]
    top_n = fields.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                              or top_n < 1):
        raise BadRequest("'top_n' must be a positive integer", param="top_n")
    # Each form's own name for echoing the document; the other's is refused.
    echo, other = ("return_text", "return_documents") if tei else (
        "return_documents", "return_text")
    if fields.get(other) is not None:
        raise BadRequest(f"'{other}' is for the "
                         + ("'documents'" if tei else "'texts' (TEI)")
                         + f" form; this request's is '{echo}'", param=other)
    return_documents = _flag(fields, echo)
    model = request_fields.model(fields)
    fields.finish(RERANK)
    generation = GenerationRequest(
        kind=EMBEDDING, inputs=[EmbeddingInput(text=d) for d in documents],
        rerank_query=query)
    return RerankRequest(generation, documents,
                         len(documents) if top_n is None else top_n,
                         return_documents, tei, model)


def shape_response(parsed: RerankRequest, scores: list[float], model: str,
                   prompt_tokens: int) -> bytes:
    """The JSON body: llama-server's (Jina's) object, or TEI's list."""
    label = "score" if parsed.tei else "relevance_score"
    # Best first; a stable sort keeps equal scores in the request's order.
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:parsed.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, label: scores[i]}
        if parsed.return_documents:
            if parsed.tei:
                item["text"] = parsed.documents[i]
            else:
                item["document"] = {"text": parsed.documents[i]}
        results.append(item)
    if parsed.tei:
        return json.dumps(results).encode()
    return json.dumps({
        "model": model, "object": "list",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results}).encode()


class RerankResource(JobEndpoint[RerankRequest]):
    """``POST /rerank`` and its aliases (``PATHS``). No prompt gate: the
    worker joins and counts each document's sequence."""

    def parse(self, body: Any) -> RerankRequest:
        parsed = parse_rerank(body)
        return dataclasses.replace(parsed, model=self._which_model(parsed.model))

    def _which_model(self, asked: str | None) -> str | None:
        """``asked``, or the pool's only reranker when none is named; a 400
        when the pool has models and none reranks."""
        models = self.models.models()
        if not models:
            return asked  # no catalog: the worker refuses a non-reranker
        rerankers = [m.name for m in models.values() if CAPABILITY in m.capabilities]
        if not rerankers:
            raise BadRequest("no model of this pool reranks: /rerank needs a "
                             "reranker model (one with a rank head: llama.cpp's "
                             "pooling 'rank')", param="model")
        if not asked and len(rerankers) == 1:
            return rerankers[0]
        return asked

    def admit(self, parsed: RerankRequest, body: Any
              ) -> Submission[RerankRequest]:
        name = parsed.generation.model
        model = self.models.seen.get(name)
        if model is not None and CAPABILITY not in model.capabilities:
            raise BadRequest(f"the model '{name[:200]}' does not rerank (it has "
                             "no rank head); rerankers here: "
                             + (", ".join(sorted(
                                 m.name for m in self.models.seen.values()
                                 if CAPABILITY in m.capabilities)[:20]) or "none"),
                             param="model")
        return Submission(parsed, parsed.generation)

    def respond(self, req: falcon.Request, resp: falcon.Response,
                submission: Submission[RerankRequest], job: Job) -> None:
        parsed = submission.parsed
        frames, final = collect_vectors(job)
        if final.finish_reason == "cancelled" or len(frames) != len(parsed.documents):
            # Never answer with part of the documents scored.
            raise UpstreamError(ErrorCode.WORKER_SHUTDOWN,
                                "the rerank job ended before every document")
        if any(len(frame) != 4 for frame in frames):
            raise UpstreamError(ErrorCode.WORKER_PROTOCOL_ERROR,
                                "the worker sent a rerank score that is not "
                                "one float32")
        scores = [struct.unpack("<f", frame)[0] for frame in frames]
        model = self.model_name(job, parsed.model)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = shape_response(parsed, scores, model, final.usage.prompt_tokens)


def add_rerank_routes(app: falcon.App, link: BrokerClient,
                      settings: FrontendSettings) -> None:
    """Register the rerank resource under each of ``PATHS``."""
    resource = RerankResource(link, settings)
    for path in PATHS:
        app.add_route(path, resource)
