"""What one job's sampling is made of, shared by both llama.cpp engines.

The one-slot engine (``workers.model.llama_engine``) samples through
``Llama.generate``; the batched engine (``workers.model.batched_engine``)
samples each slot from its own logits in a shared batch. Everything else a
request asks of sampling is the same for both and lives here:

- ``with_call_grammar``: a forced tool call becomes a grammar in the model's
  own call format;
- ``request_logits``: the request's logits processors (logit bias, bans,
  log-probabilities, the grammar), built or refused with a clear error;
- ``token_taker``: what a sampled token means: end of generation, a grammar
  with nothing left to allow, or its text and log-probability entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import llama_cpp

from protocol.errors import ErrorCode
from protocol.messages import FinishReason
from protocol.payloads import GenerationRequest
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.engine import RequestRejected
from workers.model.grammar import GrammarError
from workers.model.logits import MAX_BIASED_TOKENS, BiasError, RequestLogits
from workers.model.prompting import PromptBuilder, PromptError, ToolsUnsupported
from workers.model.tokenizing import PromptTooLong


def with_call_grammar(prompts: PromptBuilder,
                      request: GenerationRequest) -> GenerationRequest:
    """A forced call's grammar, in the model's own call format (the request
    unchanged when no call is forced).

    Raises:
        RequestRejected: the template has no call format, or the tools do
            not make a grammar.
    """
    if not request.force_call:
        return request
    try:
        grammar = prompts.call_grammar(request)
    except ToolsUnsupported as exc:
        raise RequestRejected(ErrorCode.TOOLS_UNSUPPORTED, str(exc)) from None
    except GrammarError as exc:
        raise RequestRejected(ErrorCode.INVALID_GRAMMAR, str(exc)) from None
    except PromptError as exc:
        raise RequestRejected(ErrorCode.INVALID_MESSAGES, str(exc)) from None
    return dataclasses.replace(request, grammar=grammar)


def request_logits(request: GenerationRequest, prompts: PromptBuilder, *,
                   vocab, n_vocab: int, eog_ids: list[int]) -> RequestLogits:
    """The request's logits processors (the caller closes them).

    Raises:
        RequestRejected: the grammar does not compile, or a bias names no
            token of this vocabulary.
    """
    def tokenize_bias(text: str) -> list[int]:
        # As llama.cpp's server tokenises a logit_bias text key: no BOS,
        # special tokens not parsed.
        try:
            return prompts.tokenize_piece(text, MAX_BIASED_TOKENS + 1)
        except PromptTooLong:
            raise BiasError(f"logit_bias: a text key is {MAX_BIASED_TOKENS} "
                            "tokens or more") from None

    try:
        return RequestLogits(request, vocab=vocab, n_vocab=n_vocab,
                             eog_ids=eog_ids, tokenize=tokenize_bias)
    except GrammarError as exc:
        raise RequestRejected(ErrorCode.INVALID_GRAMMAR, str(exc)) from None
    except BiasError as exc:
        raise RequestRejected(ErrorCode.UNSUPPORTED_FIELD, str(exc)) from None


def job_detokenizer(vocab, prompts: PromptBuilder,
                    request: GenerationRequest) -> IncrementalDetokenizer:
    """The job's detokeniser. With tools offered, the format's control-token
    markers are text the frontend's parser must see (llama-server's
    preserved tokens)."""
    return IncrementalDetokenizer(
        vocab, preserved=prompts.preserved_tokens()
        if request.tools or request.force_call else frozenset())


def token_taker(vocab, logits: RequestLogits, detok: IncrementalDetokenizer,
                context_used: Callable[[], int]):
    """What a sampled token means (``TokenLoop.run``'s ``take``): its text,
    log-probability entry and the tokens the context holds
    (``context_used()``), or STOP for an end-of-generation token or a
    grammar with nothing left to allow (neither counts).

    Raises (from the returned function):
        RequestRejected: the grammar's parse stacks passed their budget.
    """
    grammar, logprobs = logits.grammar, logits.logprobs
    is_eog, text_of = llama_cpp.llama_vocab_is_eog, detok.push

    def take(token: int):
        if grammar is not None and grammar.dead_end:
            # Nothing the grammar allows was left to sample.
            return FinishReason.STOP
        if is_eog(vocab, token):
            return FinishReason.STOP
        if grammar is not None:
            try:
                grammar.accept(token)  # before the next token is sampled
            except GrammarError as exc:
                raise RequestRejected(ErrorCode.INVALID_GRAMMAR, str(exc)) from None
        return (text_of(token),
                logprobs.entry(token) if logprobs is not None else None,
                context_used())

    return take
