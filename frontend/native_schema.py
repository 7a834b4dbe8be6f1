"""Validate llama.cpp's native request bodies (``/completion``, ``/infill``,
``/tokenize``, ``/detokenize``).

The samplers, stop strings, grammar and ``n_predict`` are read by the same
code as the OpenAI endpoints (``frontend.openai_schema``), so both take the
same values with the same errors. What is native only is read here:
``prompt`` as text, token ids or a mix, ``id_slot``, ``cache_prompt``,
``return_tokens``, ``n_probs``, and the infill and tokenizer fields. Any
other field gets a 400 naming it (``frontend.field_policy``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from frontend.errors import BadRequest
from frontend.field_policy import COMMON_FIELDS, check_fields
from frontend.openai_schema import (
    _bool,
    _check_stops_with_logprobs,
    _max_tokens,
    _number,
    _sampling,
    _stop,
    _timings_per_token,
    _top_count,
)
from frontend.output_constraints import grammar_of
from protocol.payloads import COMPLETION, GenerationRequest

#: ``/completion``: the OpenAI endpoints' samplers, minus OpenAI's stream
#: options, plus the native fields read here.
COMPLETION_FIELDS = (COMMON_FIELDS - {"stream_options", "max_completion_tokens"}
                     ) | {"prompt", "cache_prompt", "id_slot", "return_tokens"}
INFILL_FIELDS = COMPLETION_FIELDS | {"input_prefix", "input_suffix", "input_extra"}
TOKENIZE_FIELDS = frozenset({"content", "add_special", "parse_special",
                             "with_pieces"})
DETOKENIZE_FIELDS = frozenset({"tokens"})

#: A prompt: text, or text and token ids to be joined in order.
PromptPart = str | int


@dataclasses.dataclass(frozen=True)
class NativeRequest:
    """A native completion: ``generation`` goes to a worker once its prompt
    is settled (``prompt`` holds it as the client gave it)."""

    generation: GenerationRequest
    prompt: str | list[PromptPart]
    stream: bool
    id_slot: int
    return_tokens: bool
    #: Alternatives per token to show; 0 with ``show_probs`` off: none.
    n_probs: int
    #: Whether the response carries ``completion_probabilities``.
    show_probs: bool


def _token_id(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"'{where}' must hold token ids (non-negative integers)",
                         param=where)
    return value


def prompt_parts(value: Any, where: str = "prompt") -> str | list[PromptPart]:
    """Text, or a list of token ids and texts (llama.cpp's mixed prompt).

    A list of several texts is several prompts to llama.cpp (one answer
    each); the pool runs one prompt per request, and says so.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be a string or a list of token ids "
                         "and strings", param=where)
    if len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise BadRequest(f"'{where}' holds several prompts; send one per request",
                         param=where)
    return [v if isinstance(v, str) else _token_id(v, where) for v in value]


def _id_slot(body: dict) -> int:
    value = _number(body, "id_slot", -1, None, integer=True)
    return -1 if value is None else value


def _cache_prompt(body: dict) -> bool:
    value = _bool(body, "cache_prompt")
    return True if value is None else value


def parse_completion(body: Any, fields: frozenset[str] = COMPLETION_FIELDS
                     ) -> NativeRequest:
    """``POST /completion`` (and the common part of ``/infill``)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, fields)
    return_tokens = bool(_bool(body, "return_tokens"))
    n_probs = _top_count(body, "n_probs") or 0
    show_probs = n_probs > 0
    # Token ids travel with the log-probability entries; an entry without
    # alternatives is all that return_tokens needs.
    logprobs = n_probs if show_probs else (0 if return_tokens else None)
    stream = bool(_bool(body, "stream"))
    generation = GenerationRequest(
        kind=COMPLETION,
        max_tokens=_max_tokens(body),
        sampling=_sampling(body),
        stop=_stop(body),
        grammar=grammar_of(body),
        logprobs=logprobs,
        cache_prompt=_cache_prompt(body),
        timings_per_token=_timings_per_token(body, stream),
    )
    _check_stops_with_logprobs(generation)
    return NativeRequest(
        generation=generation,
        prompt=prompt_parts(body.get("prompt")),
        stream=stream,
        id_slot=_id_slot(body),
        return_tokens=return_tokens,
        n_probs=n_probs,
        show_probs=show_probs,
    )


@dataclasses.dataclass(frozen=True)
class InfillInput:
    prefix: str
    suffix: str
    extra: list[tuple[str, str]]  # (text, filename)


def parse_infill_input(body: dict) -> InfillInput:
    """``input_prefix``, ``input_suffix`` (required, as llama.cpp) and
    ``input_extra`` (``[{"text", "filename"}]``)."""
    texts = {}
    for name in ("input_prefix", "input_suffix"):
        value = body.get(name)
        if not isinstance(value, str):
            raise BadRequest(f'"{name}" is required and must be a string',
                             param=name)
        texts[name] = value
    raw = body.get("input_extra") or []
    if not isinstance(raw, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, '
                         '"text": string}', param="input_extra")
    extra = []
    for chunk in raw:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequest('extra_context chunk must contain a "text" field with '
                             'a string value', param="input_extra")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise BadRequest("extra_context chunk's \"filename\" field must be a "
                             "string", param="input_extra")
        extra.append((chunk["text"], filename))
    return InfillInput(texts["input_prefix"], texts["input_suffix"], extra)


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    content: str | list[PromptPart]
    add_special: bool
    parse_special: bool
    with_pieces: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    """``POST /tokenize``; llama.cpp's defaults: no BOS, specials parsed."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, TOKENIZE_FIELDS)

    def flag(name: str, default: bool) -> bool:
        value = _bool(body, name)
        return default if value is None else value

    return TokenizeRequest(prompt_parts(body.get("content"), "content"),
                           flag("add_special", False), flag("parse_special", True),
                           flag("with_pieces", False))


def parse_detokenize(body: Any) -> list[int]:
    """``POST /detokenize``: the token ids (range-checked by the caller)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens") or []
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    return [_token_id(t, "tokens") for t in tokens]
