"""What a request needs of an engine, and the one check that it has it.

Each engine says what it can do (``Engine.features``); the worker checks a
request against that once, before the engine sees it
(``refuse_unsupported``). An engine that lacks a feature never receives a
request that asks for it, so no engine has to remember to refuse, and no
field can be silently ignored by an engine that forgot to.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from protocol.errors import ErrorCode
from protocol.payloads import EMBEDDING, GenerationRequest
from workers.model.engine import RequestRejected


class Feature(enum.Enum):
    """A capability a request may need; the value names it in the refusal."""

    GRAMMAR = "grammar"
    LOGPROBS = "logprobs"
    LOGIT_BIAS = "logit_bias"
    TOOLS = "tools"
    EMBEDDINGS = "embeddings"


#: Everything: what the llama.cpp engine offers.
ALL_FEATURES = frozenset(Feature)


def features_needed(request: GenerationRequest) -> Iterator[Feature]:
    """The features ``request`` asks for, in a fixed order."""
    if request.grammar or request.force_call:  # a forced call is a grammar
        yield Feature.GRAMMAR
    if request.logprobs is not None:
        yield Feature.LOGPROBS
    if request.sampling.logit_bias:
        yield Feature.LOGIT_BIAS
    if request.tools:
        yield Feature.TOOLS
    if request.kind == EMBEDDING:
        yield Feature.EMBEDDINGS


def refuse_unsupported(request: GenerationRequest, engine_name: str,
                       features: frozenset[Feature]) -> None:
    """Raise ``RequestRejected`` (unsupported_field) naming the first feature
    the request needs and the engine lacks."""
    if request.rerank_query is not None and request.kind != EMBEDDING:
        # A peer's field that only an embedding job reads: refused, not
        # ignored (``workers.model.rerank``).
        raise RequestRejected(ErrorCode.UNSUPPORTED_FIELD,
                              f"'rerank_query' is for an embedding job, not "
                              f"{request.kind}")
    for feature in features_needed(request):
        if feature not in features:
            raise RequestRejected(
                ErrorCode.UNSUPPORTED_FIELD,
                f"the {engine_name} engine has no {feature.value}")
