"""Validate OpenAI-style request bodies into the worker's generation request.

Everything a worker needs is checked here, at the HTTP door, so bad input
never reaches a worker nor takes a slot. Each error names the offending field
the way OpenAI does (``param``). No field is silently ignored: one this
server does not implement gets a 400 (``frontend.field_policy``).

The result is a ``protocol.payloads.GenerationRequest``. A field the client
leaves out (or sends as null) is left out here too, so it takes the default
declared there: the one place the pool's sampling defaults are written.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from frontend.errors import BadRequest
from frontend.field_policy import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from frontend.output_constraints import grammar_of
from frontend.tool_calls import calls_as_text, tool_request
from protocol.limits import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_CHARS_WITH_LOGPROBS
from protocol.payloads import (
    CHAT,
    CHAT_ROLES,
    COMPLETION,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    GenerationRequest,
    LogitBias,
    Sampling,
)

#: Most stop strings per request (OpenAI allows 4; llama.cpp has no limit).
MAX_STOP_STRINGS = 16
#: OpenAI's default ``max_tokens`` for completions (chat has none: the rest
#: of the context).
COMPLETION_MAX_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """What the frontend keeps about a request; ``generation`` goes to a worker."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool
    model: str | None
    #: Tools were offered: the answer is searched for calls
    #: (``frontend.tool_calls``).
    tools: bool = False

    @property
    def logprobs(self) -> bool:
        """Whether responses carry log-probabilities."""
        return self.generation.logprobs is not None


def _number(body: dict, name: str, lo=None, hi=None, integer=False):
    """The field's value, checked; None if absent (the default applies)."""
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind}", param=name)
    if not integer and not math.isfinite(value):
        raise BadRequest(f"'{name}' must be finite", param=name)
    if lo is not None and value < lo:
        raise BadRequest(f"'{name}' must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {value}", param=name)
    return value


def _float(body: dict, name: str, lo=None, hi=None) -> float | None:
    value = _number(body, name, lo, hi)
    return None if value is None else float(value)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def _timings_per_token(body: dict, stream: bool) -> bool:
    """llama.cpp's ``timings_per_token``: timings on every streamed chunk (a
    whole answer carries its own once)."""
    return bool(_bool(body, "timings_per_token")) and stream


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(
                f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS}",
                param="stop",
            )
        return [s for s in stop if s]
    raise BadRequest("'stop' must be a string or a list of strings", param="stop")


def _max_tokens(body: dict) -> int | None:
    if body.get("n_predict") is not None:
        # llama.cpp's name; it wins over max_tokens there too. -1: no limit.
        n_predict = _number(body, "n_predict", -1, None, integer=True)
        return None if n_predict == -1 else n_predict
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
    ):
        raise BadRequest(f"'{param}' must be an integer", param=param)
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"'{param}' must be >= 0, got {max_tokens}", param=param)
    return max_tokens


def _sampling(body: dict) -> Sampling:
    n = _number(body, "n", integer=True)
    if n not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    seed = _number(body, "seed", integer=True)
    if seed is not None and not 0 <= seed < 2**32:
        raise BadRequest("'seed' must be in [0, 2^32)", param="seed")
    given = {
        "temperature": _float(body, "temperature", 0, 2),
        "top_p": _float(body, "top_p", 0, 1),
        "top_k": _number(body, "top_k", 0, None, integer=True),
        "min_p": _float(body, "min_p", 0, 1),
        "repeat_penalty": _float(body, "repeat_penalty", 0, None),
        "presence_penalty": _float(body, "presence_penalty", -2, 2),
        "frequency_penalty": _float(body, "frequency_penalty", -2, 2),
        "seed": seed,
        "ignore_eos": _bool(body, "ignore_eos"),
        "logit_bias": _logit_bias(body),
    }
    # Left out: Sampling's own defaults apply.
    return Sampling(**{k: v for k, v in given.items() if v is not None})


def _bias_entry(key: Any, value: Any, where: str) -> LogitBias:
    """One entry: a token id or a text, biased by a number or banned by
    ``false`` (llama.cpp's forms; OpenAI's keys are ids written as text)."""
    if isinstance(key, str):
        try:
            token, piece = int(key), ""
        except ValueError:
            token, piece = None, key
    elif isinstance(key, int) and not isinstance(key, bool):
        token, piece = key, ""
    else:
        raise BadRequest(f"'{where}' keys must be token ids or strings",
                         param="logit_bias")
    if token is not None and token < 0:
        raise BadRequest(f"'{where}': token {token} is negative",
                         param="logit_bias")
    if token is None and not piece:
        raise BadRequest(f"'{where}': an empty string has no tokens",
                         param="logit_bias")
    if value is False:
        return LogitBias(token=token, piece=piece, never=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value)):
        raise BadRequest(f"'{where}' values must be finite numbers or false",
                         param="logit_bias")
    return LogitBias(token=token, piece=piece, bias=float(value))


def _logit_bias(body: dict) -> list[LogitBias] | None:
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list):
        pairs = []
        for item in raw:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("'logit_bias' as a list holds [token, bias] pairs",
                                 param="logit_bias")
            pairs.append((item[0], item[1]))
    else:
        raise BadRequest("'logit_bias' must be an object or a list of pairs",
                         param="logit_bias")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"'logit_bias' has {len(pairs)} entries; at most "
                         f"{MAX_LOGIT_BIAS_ENTRIES}", param="logit_bias")
    return [_bias_entry(k, v, "logit_bias") for k, v in pairs]


def _top_count(body: dict, name: str) -> int | None:
    return _number(body, name, 0, MAX_TOP_LOGPROBS, integer=True)


def _completion_logprobs(body: dict) -> int | None:
    """OpenAI completions: ``logprobs: N``; llama.cpp: ``n_probs: N``."""
    value = body.get("logprobs")
    if value is None or value is False:
        n_probs = _top_count(body, "n_probs")
        return n_probs or None  # n_probs 0 is llama.cpp's "off"
    if value is True:
        return 0
    return _top_count(body, "logprobs")


def _chat_logprobs(body: dict) -> int | None:
    """OpenAI chat: ``logprobs: true`` and ``top_logprobs: N``."""
    wanted = _bool(body, "logprobs")
    top = _top_count(body, "top_logprobs")
    if not wanted:
        if top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true",
                             param="top_logprobs")
        n_probs = _top_count(body, "n_probs")
        return n_probs or None
    return top or 0


def _check_stops_with_logprobs(generation: GenerationRequest) -> None:
    """Tokens held back behind a stop-string prefix travel with their
    log-probabilities in one frame, whose size the wire bounds."""
    if generation.logprobs is not None and any(
            len(s) > MAX_STOP_CHARS_WITH_LOGPROBS for s in generation.stop):
        raise BadRequest(f"with logprobs, a stop string is at most "
                         f"{MAX_STOP_CHARS_WITH_LOGPROBS} characters",
                         param="stop")


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest(
            "'stream_options.include_usage' must be a boolean",
            param="stream_options.include_usage",
        )
    return stream, include


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return model


def parse_completion(body: Any) -> ParsedRequest:
    """``POST /v1/completions``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt", "")
    # OpenAI allows a batch of prompts; one string in a list is the same as one.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", param="echo")
    stream, include_usage = _stream_options(body)
    max_tokens = _max_tokens(body)
    if max_tokens is None and body.get("n_predict") is None:
        max_tokens = COMPLETION_MAX_TOKENS
    generation = GenerationRequest(
        kind=COMPLETION,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body),
        grammar=grammar_of(body),
        logprobs=_completion_logprobs(body),
        timings_per_token=_timings_per_token(body, stream),
    )
    _check_stops_with_logprobs(generation)
    return ParsedRequest(generation, stream, include_usage, _model(body))


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not (
                isinstance(part.get("text"), str)
            ):
                raise BadRequest(
                    f"{where}.content[{i}] must be a text part",
                    param=f"{where}.content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string", param=f"{where}.content")


def parse_chat(body: Any) -> ParsedRequest:
    """``POST /v1/chat/completions``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    chat = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(f"{where}.role must be one of {sorted(CHAT_ROLES)}",
                             param=f"{where}.role")
        content = _content_text(message.get("content"), where)
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise BadRequest(f"{where}.tool_calls: only an assistant "
                                 "message makes tool calls",
                                 param=f"{where}.tool_calls")
            content += calls_as_text(message["tool_calls"], f"{where}.tool_calls")
        chat.append(ChatMessage(role, content))
    if len(chat) >= 2 and chat[-1].role == chat[-2].role == "assistant":
        # llama.cpp's refusal, word for word (there, a final assistant
        # message is continued, and two of them leave no one to continue).
        raise BadRequest("Cannot have 2 or more assistant messages at the end "
                         "of the list.", param="messages")
    tools = tool_request(body)
    grammar = grammar_of(body)
    if tools.grammar:
        if grammar:
            raise BadRequest("a forced tool call ('tool_choice') cannot be "
                             "combined with a grammar or JSON schema",
                             param="tool_choice")
        grammar = tools.grammar
    stream, include_usage = _stream_options(body)
    generation = GenerationRequest(
        kind=CHAT,
        messages=chat,
        max_tokens=_max_tokens(body),
        sampling=_sampling(body),
        stop=_stop(body),
        grammar=grammar,
        logprobs=_chat_logprobs(body),
        timings_per_token=_timings_per_token(body, stream),
        tools=json.dumps(tools.tools) if tools.active else "",
    )
    _check_stops_with_logprobs(generation)
    return ParsedRequest(generation, stream, include_usage, _model(body),
                         tools=tools.active)
