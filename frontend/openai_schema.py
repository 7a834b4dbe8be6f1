"""Validate OpenAI-style request bodies into the worker's generation request.

Everything a worker needs is checked here, at the HTTP door, so bad input
never reaches a worker nor takes a slot. Each error names the offending field
the way OpenAI does (``param``). Unknown fields are ignored, as clients send
many we do not use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from frontend.errors import BadRequest

#: Most stop strings per request (OpenAI allows 4; llama.cpp has no limit).
MAX_STOP_STRINGS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """What the frontend keeps about a request; ``generation`` goes to a worker."""

    generation: dict
    stream: bool
    include_usage: bool
    model: str | None


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
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


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


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


def _sampling(body: dict) -> dict:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
    ):
        raise BadRequest(f"'{param}' must be an integer", param=param)
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"'{param}' must be >= 0, got {max_tokens}", param=param)
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    seed = _number(body, "seed", None, integer=True)
    if seed is not None and not 0 <= seed < 2**32:
        raise BadRequest("'seed' must be in [0, 2^32)", param="seed")
    return {
        "max_tokens": max_tokens,
        "temperature": float(_number(body, "temperature", 0.8, 0, 2)),
        "top_p": float(_number(body, "top_p", 0.95, 0, 1)),
        "top_k": _number(body, "top_k", 40, 0, None, integer=True),
        "min_p": float(_number(body, "min_p", 0.05, 0, 1)),
        "repeat_penalty": float(_number(body, "repeat_penalty", 1.0, 0, None)),
        "presence_penalty": float(_number(body, "presence_penalty", 0.0, -2, 2)),
        "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, -2, 2)),
        "seed": seed,
        "ignore_eos": _bool(body, "ignore_eos", False),
        "stop": _stop(body),
    }


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
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
    prompt = body.get("prompt", "")
    # OpenAI allows a batch of prompts; one string in a list is the same as one.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", param="echo")
    if body.get("logprobs") not in (None, 0, False):
        raise BadRequest("'logprobs' is not supported", param="logprobs")
    stream, include_usage = _stream_options(body)
    generation = {"kind": "completion", "prompt": prompt, **_sampling(body)}
    if generation["max_tokens"] is None:
        generation["max_tokens"] = 16  # OpenAI's default for completions
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
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    chat = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"{where}.role must be one of {sorted(CHAT_ROLES)}",
                             param=f"{where}.role")
        content = _content_text(message.get("content"), where)
        chat.append({"role": role, "content": content})
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tool calling is not supported", param="tools")
    if body.get("logprobs"):
        raise BadRequest("'logprobs' is not supported", param="logprobs")
    stream, include_usage = _stream_options(body)
    generation = {"kind": "chat", "messages": chat, **_sampling(body)}
    return ParsedRequest(generation, stream, include_usage, _model(body))
