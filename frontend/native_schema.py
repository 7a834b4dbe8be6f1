"""Validate llama.cpp's native request bodies (``/completion``, ``/infill``,
``/tokenize``, ``/detokenize``).

The samplers, stop strings, grammar and ``n_predict`` are read by the same
readers as the OpenAI endpoints (``frontend.request_fields``), so both take
the same values with the same errors. What is native only is read here:
``prompt`` as text, token ids or a mix, ``id_slot``, ``cache_prompt``,
``return_tokens``, ``n_probs``, and the infill and tokenizer fields
(``cache_salt`` is shared with the OpenAI endpoints). Any
other field gets a 400 naming it, unless ``frontend.field_policy`` accepts
it unread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from frontend import field_policy, request_fields
from frontend.errors import BadRequest
from frontend.output_constraints import grammar_of
from frontend.request_fields import RequestFields, top_count
from protocol.payloads import COMPLETION, GenerationRequest

#: What ``parse_infill_input`` reads: ``/infill`` reads them after checking
#: that the model can infill at all (llama.cpp's order), so its parser
#: defers them to that step.
INFILL_INPUT_FIELDS = ("input_prefix", "input_suffix", "input_extra")

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
    #: The model the client named (answered back when the pool names none).
    model: str | None = None
    #: llama.cpp's ``response_fields``: the final answer's fields to keep
    #: (``a/b`` moves a nested one to the top); empty: all of them.
    response_fields: tuple[str, ...] = ()


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


def parse_completion(body: Any, infill: bool = False) -> NativeRequest:
    """``POST /completion`` (and the common part of ``/infill``)."""
    fields = RequestFields(body)
    return_tokens = bool(fields.flag("return_tokens"))
    n_probs = top_count(fields, "n_probs") or 0
    show_probs = n_probs > 0
    # Token ids travel with the log-probability entries; an entry without
    # alternatives is all that return_tokens needs.
    logprobs = n_probs if show_probs else (0 if return_tokens else None)
    stream = request_fields.stream(fields)
    generation = GenerationRequest(
        kind=COMPLETION,
        # llama.cpp's own names: OpenAI's max_completion_tokens is not one.
        max_tokens=request_fields.max_tokens(fields, ("max_tokens",)),
        sampling=request_fields.sampling(fields),
        stop=request_fields.stop(fields),
        grammar=grammar_of(fields),
        logprobs=logprobs,
        cache_prompt=bool(fields.flag("cache_prompt", True)),
        timings_per_token=request_fields.timings_per_token(fields, stream),
        cache_tenant=request_fields.cache_salt(fields),
        defaulted=request_fields.left_out(fields, ("max_tokens",)),
    )
    request_fields.check_stops_with_logprobs(generation)
    parsed = NativeRequest(
        generation=generation,
        prompt=prompt_parts(fields.get("prompt")),
        stream=stream,
        id_slot=_id_slot(fields),
        return_tokens=return_tokens,
        n_probs=n_probs,
        show_probs=show_probs,
        model=request_fields.model(fields),
        response_fields=_response_fields(fields),
    )
    # llama.cpp's ``verbose`` adds ``__verbose`` (the native answer) to its
    # OpenAI-shaped answers only; its native answer is the same either way,
    # and already echoes the rendered ``prompt``. Read, so checked.
    fields.flag("verbose")
    if infill:
        fields.defer(*INFILL_INPUT_FIELDS)
    fields.finish(field_policy.DEFAULT)
    return parsed


#: Most ``response_fields`` paths one request may give.
MAX_RESPONSE_FIELDS = 64


def _response_fields(fields: RequestFields) -> tuple[str, ...]:
    return tuple(request_fields.string_list(fields, "response_fields",
                                            MAX_RESPONSE_FIELDS, "paths"))


def _id_slot(fields: RequestFields) -> int:
    value = fields.number("id_slot", -1, None, integer=True)
    return -1 if value is None else value


@dataclasses.dataclass(frozen=True)
class InfillInput:
    prefix: str
    suffix: str
    extra: list[tuple[str, str]]  # (text, filename)


def parse_infill_input(body: dict) -> InfillInput:
    """``input_prefix``, ``input_suffix`` (required, as llama.cpp) and
    ``input_extra`` (``[{"text", "filename"}]``)."""
    texts = {}
    for name in INFILL_INPUT_FIELDS[:2]:
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
    #: Whose vocabulary (a pool of several models: ``frontend.native_api``).
    model: str | None = None


@dataclasses.dataclass(frozen=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


def parse_tokenize(body: Any) -> TokenizeRequest:
    """``POST /tokenize``; llama.cpp's defaults: no BOS, specials parsed."""
    fields = RequestFields(body)
    parsed = TokenizeRequest(prompt_parts(fields.get("content"), "content"),
                             fields.flag("add_special", False),
                             fields.flag("parse_special", True),
                             fields.flag("with_pieces", False),
                             request_fields.model(fields))
    fields.finish(field_policy.DEFAULT)
    return parsed


def parse_detokenize(body: Any) -> DetokenizeRequest:
    """``POST /detokenize``: the token ids (range-checked by the caller)."""
    fields = RequestFields(body)
    tokens = fields.get("tokens") or []
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    model = request_fields.model(fields)
    fields.finish(field_policy.DEFAULT)
    return DetokenizeRequest([_token_id(t, "tokens") for t in tokens], model)
