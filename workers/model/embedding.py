"""Embedding jobs in a generation worker: a second llama.cpp context.

Why a second context and not the generation context with embeddings toggled
on (``llama_set_embeddings``): the pooling type is fixed when a context is
made, and the generation context's is the model's own, which for a causal LM
such as Gemma 3 is "none" (llama.cpp's server then refuses ``/v1/embeddings``
outright). Decoding an input in the generation context would also overwrite
the KV cache that ``kv_cache.plan_reuse`` and the broker's prefix routing
count on. The second context shares the model's weights; it costs its own
KV cache and compute buffer, sized for one input (``tests/bench/
bench_embeddings.py`` measures it), and is made on the first embedding job,
so a pool that never embeds never pays for it.

Pooling: the model's own if it has one, else mean (the usual choice for a
causal LM's sentence vector). Normalisation follows llama.cpp's
``common_embd_normalize`` (``embd_normalize``, default 2: unit Euclidean
length). A model with a rank head (pooling rank) is mean-pooled here, and
its rerank jobs (``workers.model.rerank``) get a context of their own with
pooling rank, made on the first one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import llama_cpp
import numpy as np

from protocol.errors import ErrorCode
from protocol.payloads import EmbeddingInput, GenerationRequest
from workers.model import llama_internals
from workers.model.engine import GenerationResult, JobSink, RequestRejected
from workers.model.prompting import PromptBuilder
from workers.model.rerank import rank_job
from workers.model.token_loop import EmbeddingLoop, cancelled_while_tokenizing
from workers.model.tokenizing import PromptTooLong, TokenizeCancelled

#: Tokens one input may have: the embedding context's size and its physical
#: batch (a pooled input must be decoded in one ubatch, as in llama.cpp).
DEFAULT_EMBEDDING_BATCH_TOKENS = 512

#: Tokens one request may have over all its inputs: a batch of inputs is one
#: job holding one slot, so this bounds how long it holds it.
MAX_EMBEDDING_REQUEST_TOKENS = 32768


def normalize(vector: np.ndarray, mode: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize``.

    -1: none; 0: max absolute, scaled to int16 range; 1: taxicab; 2:
    Euclidean; >2: p-norm. A zero vector stays zero.
    """
    v = vector.astype(np.float64)
    if mode < 0:
        return vector
    if mode == 0:
        total = np.max(np.abs(v)) / 32760.0
    elif mode == 2:
        total = np.sqrt(np.sum(v * v))
    else:
        total = np.sum(np.abs(v) ** mode) ** (1.0 / mode)
    if total <= 0:
        return np.zeros_like(vector)
    return (v / total).astype(np.float32)


class Embedder:
    """Pooled, normalised vectors for token lists, one input per decode.

    Args:
        llama: the generation ``Llama`` (its model's weights are shared).
        prompts: its prompt builder, for bounded tokenising.
        n_threads: threads for decode, as for generation.
        batch_tokens: the largest input, in tokens.
    """

    def __init__(self, llama: llama_cpp.Llama, prompts: PromptBuilder, *,
                 n_threads: int | None,
                 batch_tokens: int = DEFAULT_EMBEDDING_BATCH_TOKENS) -> None:
        self._llama = llama
        self._prompts = prompts
        self._n_threads = n_threads
        self.batch_tokens = batch_tokens
        self._ctx: llama_internals.LlamaContext | None = None
        #: Rerank jobs' context (pooling rank), made on the first one: a
        #: rank head's output is its labels' scores, not a vector.
        self._rank_ctx: llama_internals.LlamaContext | None = None
        self._batch: llama_internals.LlamaBatch | None = None
        self.n_embd = llama.n_embd()
        #: The model has a rank head (its GGUF's pooling type is rank, as
        #: llama.cpp's converter writes for a reranker): it takes rerank jobs.
        self.ranks = llama.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_RANK

    @property
    def llama(self) -> llama_cpp.Llama:
        return self._llama

    @property
    def prompts(self) -> PromptBuilder:
        return self._prompts

    def _context(self, rank: bool = False) -> llama_internals.LlamaContext:
        ctx = self._rank_ctx if rank else self._ctx
        if ctx is None:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = self.batch_tokens
            params.n_seq_max = 1
            params.embeddings = True
            model_pooling = self._llama.pooling_type()
            params.pooling_type = (
                llama_cpp.LLAMA_POOLING_TYPE_RANK if rank
                else model_pooling if model_pooling > llama_cpp.LLAMA_POOLING_TYPE_NONE
                and model_pooling != llama_cpp.LLAMA_POOLING_TYPE_RANK
                else llama_cpp.LLAMA_POOLING_TYPE_MEAN)
            threads = self._llama.context_params.n_threads
            params.n_threads = params.n_threads_batch = self._n_threads or threads
            ctx = llama_internals.new_context(self._llama, params)
            if rank:
                self._rank_ctx = ctx
            else:
                self._ctx = ctx
            if self._batch is None:
                self._batch = llama_internals.new_batch(self.batch_tokens)
        return ctx

    def tokens_of(self, i: int, item: EmbeddingInput,
                  should_stop: Callable[[], bool]) -> list[int]:
        """Input ``i``'s tokens, refused if empty or longer than the batch.

        Text gets BOS and special tokens parsed, as llama.cpp's server
        tokenises embedding inputs; it is tokenised with bounded work
        (``workers.model.tokenizing``), stopping once past the batch.
        """
        if item.tokens is not None:
            n_vocab = self._llama.n_vocab()
            if not all(0 <= t < n_vocab for t in item.tokens):
                raise RequestRejected(ErrorCode.INVALID_PROMPT_TOKENS,
                                      f"input[{i}]: token ids must be in the "
                                      "vocabulary")
            tokens = item.tokens
        else:
            try:
                tokens = self._prompts.tokenize_text(
                    item.text, limit=self.batch_tokens + 1, should_stop=should_stop)
            except PromptTooLong as exc:
                raise self._too_large(i, f"at least {exc.at_least}") from None
        if not tokens:
            raise RequestRejected(ErrorCode.INVALID_PROMPT_TOKENS,
                                  f"input[{i}]: Input content cannot be empty")
        if len(tokens) > self.batch_tokens:
            raise self._too_large(i, str(len(tokens)))
        return tokens

    def _too_large(self, i: int, counted: str) -> RequestRejected:
        # llama.cpp's text (server-context.cpp), plus which input.
        return RequestRejected(
            ErrorCode.INPUT_TOO_LARGE,
            f"input[{i}]: input ({counted} tokens) is too large to process. "
            f"increase the physical batch size (current batch size: "
            f"{self.batch_tokens})")

    def vector(self, tokens: list[int], normalize_mode: int) -> np.ndarray:
        """One input's pooled vector (``tokens`` fits ``batch_tokens``)."""
        ctx = self._context()
        # Each input is its own sequence from position 0.
        llama_internals.decode_alone(ctx, self._batch, tokens)
        ptr = llama_internals.pooled_embedding(ctx)
        if not ptr:
            raise RuntimeError("llama.cpp returned no pooled embedding")
        raw = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
        return normalize(raw, normalize_mode)

    def score(self, tokens: list[int]) -> float:
        """One query-document sequence's relevance: the rank head's first
        output, as llama.cpp's server reads it (``send_rerank``)."""
        ctx = self._context(rank=True)
        llama_internals.decode_alone(ctx, self._batch, tokens)
        ptr = llama_internals.pooled_embedding(ctx)
        if not ptr:
            raise RuntimeError("llama.cpp returned no rank score")
        return float(ptr[0])

    def run(self, request: GenerationRequest, sink: JobSink) -> GenerationResult:
        """Emit one frame per input, in order; refuse before any decode if an
        input is empty or too large, so the client gets a 400."""
        if request.rerank_query is not None:
            return rank_job(self, request, sink)
        started = time.perf_counter()
        if request.dimensions is not None and request.dimensions != self.n_embd:
            raise RequestRejected(
                ErrorCode.UNSUPPORTED_FIELD,
                f"'dimensions' is not supported: this model's embeddings have "
                f"{self.n_embd} dimensions and are not truncated")
        try:
            all_tokens = [self.tokens_of(i, item, sink.should_stop)
                          for i, item in enumerate(request.inputs)]
        except TokenizeCancelled:
            return cancelled_while_tokenizing(started)
        total = sum(len(tokens) for tokens in all_tokens)
        if total > MAX_EMBEDDING_REQUEST_TOKENS:
            raise RequestRejected(
                ErrorCode.INPUT_TOO_LARGE,
                f"input: {total} tokens in all; one request may have at most "
                f"{MAX_EMBEDDING_REQUEST_TOKENS}")
        loop = EmbeddingLoop(sink, started=started, n_tokens=total)
        mode = request.embd_normalize
        # Each ``next`` decodes one input, after the loop's cancel check.
        vectors = ((tokens, self.vector(tokens, mode)) for tokens in all_tokens)
        return loop.result(loop.run(vectors, _frame_of))


def _frame_of(unit: tuple[list[int], np.ndarray]) -> tuple[bytes, int, int]:
    """An embedded input's frame (its vector as little-endian float32, and
    its token count), and the context in use: that input."""
    tokens, vector = unit
    return vector.astype("<f4").tobytes(), len(tokens), len(tokens)
