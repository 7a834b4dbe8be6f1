"""Rerank jobs: a query and documents in, one relevance score per document.

A rerank job is an embedding job (``GenerationRequest.kind`` embedding)
with ``rerank_query`` set: it runs on the same second, pooled context
machinery (``workers.model.embedding.Embedder``), with the pooling llama.cpp
calls rank, so the model's rank head (``cls``/``cls.output`` tensors) turns
each sequence into its labels' scores, and the score is the first one, as
llama.cpp's server reads it (``send_rerank``). One sequence per document,
each decoded alone, as embedding inputs are.

How a query and a document become one sequence is llama.cpp's
``format_prompt_rerank``: a model with a ``rerank`` chat template has
``{query}`` and ``{document}`` put in it and the result tokenised with
special tokens parsed and none added; any other model gets
``[BOS] query [EOS] [SEP] document [EOS]``, each marker only where its
vocabulary asks to add it (EOS falls back to SEP). One difference: the
template's two fields are filled in one pass, so a query that happens to
contain ``{document}`` stays as written (llama.cpp replaces it too).
"""

from __future__ import annotations

import re
import struct
import time
from typing import TYPE_CHECKING

import llama_cpp

from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest
from workers.model import llama_internals
from workers.model.engine import GenerationResult, JobSink, RequestRejected
from workers.model.token_loop import EmbeddingLoop, cancelled_while_tokenizing
from workers.model.tokenizing import PromptTooLong, TokenizeCancelled

if TYPE_CHECKING:
    from collections.abc import Callable

    from workers.model.embedding import Embedder

#: Tokens one rerank request may have over all its documents: as for
#: embeddings, a batch is one job holding one slot.
MAX_RERANK_REQUEST_TOKENS = 32768

_FIELDS = re.compile(r"\{query\}|\{document\}")


class SequenceFormat:
    """How this model joins a query and a document (the module's rules)."""

    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder
        llama = embedder.llama
        raw = llama_cpp.llama_model_chat_template(
            llama_internals.model_handle(llama), b"rerank")
        self.template = raw.decode("utf-8", errors="replace") if raw else None
        vocab = llama_internals.vocab_handle(llama)
        eos = llama_cpp.llama_vocab_eos(vocab)
        sep = llama_cpp.llama_vocab_sep(vocab)
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = sep
        self.bos = ([llama_cpp.llama_vocab_bos(vocab)]
                    if llama_cpp.llama_vocab_get_add_bos(vocab) else [])
        self.eos = [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
        self.sep = [sep] if llama_cpp.llama_vocab_get_add_sep(vocab) else []

    def _tokens(self, text: str, where: str, template: bool,
                should_stop: Callable[[], bool]) -> list[int]:
        limit = self._embedder.batch_tokens
        try:
            return self._embedder.prompts.tokenize_text(
                text, limit=limit + 1, add_special=False, parse_special=template,
                should_stop=should_stop)
        except PromptTooLong as exc:
            raise too_large(where, f"at least {exc.at_least}", limit) from None

    def sequences(self, query: str, documents: list[str],
                  should_stop: Callable[[], bool]) -> list[list[int]]:
        """Each document's sequence, refused if one is empty or too long."""
        limit = self._embedder.batch_tokens
        out = []
        query_tokens = (None if self.template is not None
                        else self._tokens(query, "query", False, should_stop))
        for i, doc in enumerate(documents):
            where = f"documents[{i}]"
            if self.template is not None:
                tokens = self._tokens(fill(self.template, query, doc), where,
                                      True, should_stop)
            else:
                tokens = (self.bos + query_tokens + self.eos + self.sep
                          + self._tokens(doc, where, False, should_stop) + self.eos)
            if not tokens:
                raise RequestRejected(ErrorCode.INVALID_PROMPT_TOKENS,
                                      f"{where}: the query and document are "
                                      "both empty")
            if len(tokens) > limit:
                raise too_large(where, str(len(tokens)), limit)
            out.append(tokens)
        return out


def fill(template: str, query: str, document: str) -> str:
    """The rerank template with its ``{query}`` and ``{document}`` filled in,
    in one pass (the module's one difference from llama.cpp)."""
    return _FIELDS.sub(lambda m: query if m.group() == "{query}" else document,
                       template)


def too_large(where: str, counted: str, limit: int) -> RequestRejected:
    # llama.cpp's text (server-context.cpp), plus which document.
    return RequestRejected(
        ErrorCode.INPUT_TOO_LARGE,
        f"{where}: input ({counted} tokens) is too large to process. increase "
        f"the physical batch size (current batch size: {limit})")


def rank_job(embedder: Embedder, request: GenerationRequest,
             sink: JobSink) -> GenerationResult:
    """Emit one frame per document, in order (its score as one little-endian
    float32); refuse before any decode if the model has no rank head or a
    document cannot be scored, so the client gets a 400."""
    started = time.perf_counter()
    if not embedder.ranks:
        raise RequestRejected(
            ErrorCode.UNSUPPORTED_FIELD,
            "this model does not rerank: it has no rank head (llama.cpp's "
            "pooling 'rank')")
    if any(item.tokens is not None for item in request.inputs):
        raise RequestRejected(ErrorCode.UNSUPPORTED_FIELD,
                              "rerank documents must be text, not token ids")
    try:
        sequences = SequenceFormat(embedder).sequences(
            request.rerank_query or "", [item.text for item in request.inputs],
            sink.should_stop)
    except TokenizeCancelled:
        return cancelled_while_tokenizing(started)
    total = sum(len(tokens) for tokens in sequences)
    if total > MAX_RERANK_REQUEST_TOKENS:
        raise RequestRejected(
            ErrorCode.INPUT_TOO_LARGE,
            f"documents: {total} tokens in all, with the query; one request "
            f"may have at most {MAX_RERANK_REQUEST_TOKENS}")
    loop = EmbeddingLoop(sink, started=started, n_tokens=total)
    # Each ``next`` decodes one document, after the loop's cancel check.
    scores = ((tokens, embedder.score(tokens)) for tokens in sequences)
    return loop.result(loop.run(scores, _frame_of))


def _frame_of(unit: tuple[list[int], float]) -> tuple[bytes, int, int]:
    """A scored document's frame (the score as float32, and its sequence's
    token count), and the context in use: that sequence."""
    tokens, score = unit
    return struct.pack("<f", score), len(tokens), len(tokens)
