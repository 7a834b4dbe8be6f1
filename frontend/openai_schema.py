"""Validate OpenAI-style request bodies into the worker's generation request.

Everything a worker needs is checked here, at the HTTP door, so bad input
never reaches a worker nor takes a slot. Each error names the offending field
the way OpenAI does (``param``). No field is silently ignored: one that no
reader here read gets a 400 (``frontend.request_fields``).

The result is a ``protocol.payloads.GenerationRequest``. A field the client
leaves out (or sends as null) is left out here too, so it takes the default
declared there: the one place the pool's sampling defaults are written.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from frontend import field_policy, request_fields
from frontend.chat_continuation import continuation
from frontend.errors import BadRequest
from frontend.output_constraints import grammar_of
from frontend.reasoning import reasoning_format, template_kwargs
from frontend.request_fields import RequestFields, top_count
from frontend.tool_calls import history_calls, tool_request
from protocol.payloads import (
    CHAT,
    CHAT_ROLES,
    COMPLETION,
    ChatMessage,
    GenerationRequest,
)

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
    #: ``reasoning_format`` (``frontend.reasoning``); None: not given.
    reasoning_format: str | None = None

    @property
    def logprobs(self) -> bool:
        """Whether responses carry log-probabilities."""
        return self.generation.logprobs is not None


def _completion_logprobs(fields: RequestFields) -> int | None:
    """OpenAI completions: ``logprobs: N``; llama.cpp: ``n_probs: N`` (read
    but overruled when ``logprobs`` is given)."""
    value = fields.get("logprobs")
    if value is None or value is False:
        n_probs = top_count(fields, "n_probs")
        return n_probs or None  # n_probs 0 is llama.cpp's "off"
    fields.get("n_probs")
    if value is True:
        return 0
    return top_count(fields, "logprobs")


def _chat_logprobs(fields: RequestFields) -> int | None:
    """OpenAI chat: ``logprobs: true`` and ``top_logprobs: N`` (llama.cpp's
    ``n_probs`` is read but overruled when ``logprobs`` is true)."""
    wanted = fields.flag("logprobs")
    top = top_count(fields, "top_logprobs")
    if not wanted:
        if top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true",
                             param="top_logprobs")
        n_probs = top_count(fields, "n_probs")
        return n_probs or None
    fields.get("n_probs")
    return top or 0


def parse_completion(body: Any) -> ParsedRequest:
    """``POST /v1/completions``."""
    fields = RequestFields(body)
    prompt = fields.get("prompt", "")
    # OpenAI allows a batch of prompts; one string in a list is the same as one.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    if fields.get("echo"):
        raise BadRequest("'echo' is not supported", param="echo")
    stream = request_fields.stream(fields)
    include_usage = request_fields.stream_options(fields)
    max_tokens = request_fields.max_tokens(fields)
    if max_tokens is None and fields.get("n_predict") is None:
        max_tokens = COMPLETION_MAX_TOKENS
    generation = GenerationRequest(
        kind=COMPLETION,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=request_fields.sampling(fields),
        stop=request_fields.stop(fields),
        grammar=grammar_of(fields),
        logprobs=_completion_logprobs(fields),
        defaulted=request_fields.left_out(fields),
        timings_per_token=request_fields.timings_per_token(fields, stream),
        cache_tenant=request_fields.cache_salt(fields),
    )
    request_fields.check_stops_with_logprobs(generation)
    model = request_fields.model(fields)
    fields.finish(field_policy.DEFAULT)
    return ParsedRequest(generation, stream, include_usage, model)


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


def _history_reasoning(message: dict, role: str, where: str) -> str:
    """An earlier assistant turn's reasoning, under either name clients
    send it (llama.cpp's ``reasoning_content``, vLLM's ``reasoning``)."""
    given = [(k, message[k]) for k in ("reasoning_content", "reasoning")
             if message.get(k) is not None]
    for name, value in given:
        if not isinstance(value, str):
            raise BadRequest(f"{where}.{name} must be a string",
                             param=f"{where}.{name}")
        if role != "assistant":
            raise BadRequest(f"{where}.{name}: only an assistant message has "
                             "reasoning", param=f"{where}.{name}")
    return given[0][1] if given else ""


def parse_chat(body: Any) -> ParsedRequest:
    """``POST /v1/chat/completions``."""
    fields = RequestFields(body)
    raw = fields.get("messages")
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
        calls = []
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise BadRequest(f"{where}.tool_calls: only an assistant "
                                 "message makes tool calls",
                                 param=f"{where}.tool_calls")
            calls = history_calls(message["tool_calls"], f"{where}.tool_calls")
        chat.append(ChatMessage(role, content,
                                _history_reasoning(message, role, where), calls))
    if len(chat) >= 2 and chat[-1].role == chat[-2].role == "assistant":
        # llama.cpp's refusal, word for word (there, a final assistant
        # message is continued, and two of them leave no one to continue).
        raise BadRequest("Cannot have 2 or more assistant messages at the end "
                         "of the list.", param="messages")
    tools = tool_request(fields)
    grammar = grammar_of(fields)
    if tools.force and grammar:
        raise BadRequest("a forced tool call ('tool_choice') cannot be "
                         "combined with a grammar or JSON schema",
                         param="tool_choice")
    add_generation_prompt, continue_final = continuation(fields, chat)
    stream = request_fields.stream(fields)
    include_usage = request_fields.stream_options(fields)
    generation = GenerationRequest(
        kind=CHAT,
        messages=chat,
        max_tokens=request_fields.max_tokens(fields),
        sampling=request_fields.sampling(fields),
        stop=request_fields.stop(fields),
        grammar=grammar,
        logprobs=_chat_logprobs(fields),
        timings_per_token=request_fields.timings_per_token(fields, stream),
        tools=json.dumps(tools.tools) if tools.active else "",
        cache_tenant=request_fields.cache_salt(fields),
        chat_template_kwargs=template_kwargs(fields),
        force_call=tools.force,
        add_generation_prompt=add_generation_prompt,
        continue_final=continue_final,
        defaulted=request_fields.left_out(fields),
    )
    request_fields.check_stops_with_logprobs(generation)
    model = request_fields.model(fields)
    split = reasoning_format(fields)
    fields.finish(field_policy.DEFAULT)
    return ParsedRequest(generation, stream, include_usage, model,
                         tools=tools.active, reasoning_format=split)
