"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
read into the chat job every other chat endpoint submits.

A request becomes chat turns (``ChatMessage``) rendered by the model's own
template, so it gets the same prompt gate, prefix routing and prompt-state
cache as ``/v1/chat/completions``:

* ``system`` (a string or text blocks) is one system turn. A text block that
  is Claude Code's attribution line (``x-anthropic-billing-header: ...;
  cch=<nonce>;``) is dropped: it is billing metadata for Anthropic's own
  servers, and its nonce changes on every request, so at the head of the
  prompt it would make every turn miss the prompt cache.
* ``tool_use`` blocks of an assistant turn go back as the turn's calls
  (``frontend.tool_calls.history_calls``), which the worker renders in the
  call form the model was taught, and each
  ``tool_result`` block is a ``tool`` turn, in the order they came.
* ``tools`` and ``tool_choice`` become chat's (``offered_tools``): ``any``
  and ``tool`` are a grammar that forces one call.

Every key of the body, of a message and of a block is read or refused: a
client learns that an image or a server tool is not served,
instead of getting an answer made without it. ``cache_control`` is accepted
and changes nothing: every prompt prefix is cached already.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from frontend import field_policy, model_code, request_fields
from frontend.errors import BadRequest
from frontend.field_policy import FieldPolicy
from frontend.nested_fields import object_with, string_in
from frontend.request_fields import MAX_STOP_STRINGS, RequestFields
from frontend.tool_calls import (
    ToolRequest,
    history_calls,
    offered_tools,
    tool_name,
)
from protocol.payloads import CHAT, ChatMessage, GenerationRequest, Sampling

#: ``metadata`` (``user_id``) labels a request, ``service_tier`` picks
#: Anthropic's capacity and a top-level ``cache_control`` asks for prompt
#: caching, which every prompt gets here: none changes an answer (README).
POLICY = FieldPolicy(frozenset({"metadata", "service_tier", "cache_control"}))

#: Claude Code's per-request attribution line (see the module docstring).
ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"

#: Anthropic's ``tool_choice`` types, and chat's for each.
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclasses.dataclass(frozen=True)
class MessagesRequest:
    """A checked ``/v1/messages`` body; ``generation`` goes to a worker."""

    generation: GenerationRequest
    stream: bool
    model: str | None
    #: Tools were offered: the answer is searched for calls.
    tools: bool = False
    #: ``disable_parallel_tool_use``: at most one call is answered.
    single_call: bool = False
    #: The client's ``stop_sequences`` (a match is ``stop_reason:
    #: "stop_sequence"``).
    stop_sequences: tuple[str, ...] = ()
    #: ``thinking``: on (``enabled``, ``adaptive``), off, or None (not given).
    thinking: bool | None = None


_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})


def _text_block(block: Any, where: str) -> str:
    block = object_with(block, _TEXT_KEYS, where)
    if block.get("citations"):
        raise BadRequest(f"{where}.citations is not supported",
                         param=f"{where}.citations")
    return string_in(block, "text", where)


def system_text(system: Any) -> str:
    """``system``: a string, or text blocks joined by blank lines, without
    Claude Code's attribution line."""
    if system is None:
        return ""
    if isinstance(system, str):
        return _without_attribution(system)
    if not isinstance(system, list):
        raise BadRequest("'system' must be a string or a list of text blocks",
                         param="system")
    texts = []
    for i, block in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise BadRequest(f"{where} must be a text block", param=where)
        text = _without_attribution(_text_block(block, where))
        if text:
            texts.append(text)
    return "\n\n".join(texts)


def _without_attribution(text: str) -> str:
    if not text.startswith(ATTRIBUTION_PREFIX):
        return text
    _, _, rest = text.partition("\n")
    return rest.lstrip("\n")


_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
_TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error",
                               "cache_control"})
_THINKING_KEYS = frozenset({"type", "thinking", "signature"})


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(part, f"{where}.content[{i}]")
                          for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or text blocks",
                         param=f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise BadRequest(f"{where}.is_error must be a boolean",
                         param=f"{where}.is_error")
    # A template has no place for the flag; the model reads it in the text.
    return f"Error: {content}" if is_error else content


def _user_turns(content: list, where: str) -> list[ChatMessage]:
    """A user message's blocks: runs of text are one user turn, and each
    ``tool_result`` is a ``tool`` turn, in their order."""
    turns: list[ChatMessage] = []
    texts: list[str] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            if texts:
                turns.append(ChatMessage("user", "".join(texts)))
                texts = []
            block = object_with(block, _TOOL_RESULT_KEYS, at)
            string_in(block, "tool_use_id", at)
            turns.append(ChatMessage("tool", _tool_result_text(block, at)))
        else:
            raise BadRequest(f"{at}: a user message's blocks must be 'text' or "
                             f"'tool_result' (got {str(kind)[:40]!r})", param=at)
    if texts or not turns:
        turns.append(ChatMessage("user", "".join(texts)))
    return turns


def _assistant_turn(content: list, where: str) -> ChatMessage:
    """An assistant message's text and calls, as the model wrote them, and
    its ``thinking`` as the turn's reasoning (the template decides whether
    to show it again). ``redacted_thinking`` is refused: it is Anthropic's
    encrypted reasoning, which no other model can read."""
    texts, calls, thoughts = [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            block = object_with(block, _TOOL_USE_KEYS, at)
            string_in(block, "id", at)
            name = string_in(block, "name", at)
            if not isinstance(block.get("input"), dict):
                raise BadRequest(f"{at}.input must be an object",
                                 param=f"{at}.input")
            calls.append({"id": block.get("id"), "function": {
                "name": name,
                "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "thinking":
            thoughts.append(string_in(object_with(block, _THINKING_KEYS, at),
                                      "thinking", at))
        else:
            raise BadRequest(f"{at}: an assistant message's blocks must be "
                             f"'text', 'tool_use' or 'thinking' (got "
                             f"{str(kind)[:40]!r})", param=at)
    text = "".join(texts)
    history = history_calls(calls, f"{where}.content") if calls else []
    return ChatMessage("assistant", text, "\n".join(thoughts), history)


_MESSAGE_KEYS = frozenset({"role", "content"})


def chat_turns(raw: Any, system: str) -> list[ChatMessage]:
    """``messages`` (and the system text) as chat turns."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    turns = [ChatMessage("system", system)] if system else []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        message = object_with(message, _MESSAGE_KEYS, where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'",
                             param=f"{where}.role")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of "
                             "blocks", param=f"{where}.content")
        if role == "user":
            turns += _user_turns(content, where)
        else:
            turns.append(_assistant_turn(content, where))
    if raw[-1].get("role") == "assistant" and turns[-1].tool_calls:
        # Anthropic continues a final assistant turn (a prefill,
        # ``prefilled``); one that calls tools has nothing to continue.
        where = f"messages[{len(raw) - 1}]"
        raise BadRequest(f"{where}: a final assistant message (a prefill) "
                         "cannot hold tool_use blocks", param=where)
    return turns


def prefilled(turns: list[ChatMessage]) -> bool:
    """A final assistant turn is continued, not closed (Anthropic's prefill;
    the worker leaves it open: ``GenerationRequest.continue_final``)."""
    return bool(turns) and turns[-1].role == "assistant"


_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema",
                        "cache_control"})


def _tool(tool: Any, i: int) -> dict:
    """An Anthropic client tool, in chat's shape."""
    where = f"tools[{i}]"
    if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
        # Anthropic's server tools (web search, code execution, bash, the
        # text editor...) run at Anthropic: there is nothing to run them.
        raise BadRequest(f"{where}.type {str(tool['type'])[:60]!r} is not "
                         "supported: only client tools (with 'input_schema')",
                         param=f"{where}.type")
    tool = object_with(tool, _TOOL_KEYS, where)
    name = tool_name(tool.get("name"), f"{where}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.input_schema must be a JSON schema object",
                         param=f"{where}.input_schema")
    fn = {"name": name, "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = string_in(tool, "description", where)
    return {"type": "function", "function": fn}


_CHOICE_KEYS = frozenset({"type", "name", "disable_parallel_tool_use"})


def tool_choice(choice: Any) -> tuple[Any, bool]:
    """Chat's ``tool_choice`` for Anthropic's, and whether parallel calls
    are disabled."""
    if choice is None:
        return None, False
    choice = object_with(choice, _CHOICE_KEYS, "tool_choice")
    kind = choice.get("type")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use must be a "
                         "boolean", param="tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        return {"type": "function", "function": {
            "name": string_in(choice, "name", "tool_choice")}}, single
    if kind not in _CHOICES or "name" in choice:
        raise BadRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | "
                         "\"none\"} or {\"type\": \"tool\", \"name\": ...}",
                         param="tool_choice.type")
    return _CHOICES[kind], single


def tools_of(fields: RequestFields) -> tuple[ToolRequest, bool]:
    """``tools`` and ``tool_choice``, checked and in chat's shape."""
    tools = fields.get("tools")
    choice, single = tool_choice(fields.get("tool_choice"))
    if tools is None:
        return offered_tools(None, choice), single
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    offered = offered_tools([_tool(t, i) for i, t in enumerate(tools)], choice)
    return offered, single and offered.active


def thinking(fields: RequestFields, max_tokens: int | None = None
             ) -> bool | None:
    """``thinking``: ``enabled`` (with its ``budget_tokens``), ``adaptive``
    or ``disabled``; None when not given. The budget is checked as Anthropic
    checks it (at least 1024, below ``max_tokens``); the reasoning is
    bounded by ``max_tokens`` only (README)."""
    value = fields.get("thinking")
    if value is None:
        return None
    value = object_with(value, frozenset({"type", "budget_tokens"}), "thinking")
    kind = value.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise BadRequest("thinking.type must be 'enabled', 'adaptive' or "
                         "'disabled'", param="thinking.type")
    budget = value.get("budget_tokens")
    if kind == "enabled":
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise BadRequest("thinking.budget_tokens must be an integer >= 1024",
                             param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise BadRequest("thinking.budget_tokens must be less than "
                             "max_tokens", param="thinking.budget_tokens")
    elif budget is not None:
        raise BadRequest("thinking.budget_tokens is only for type 'enabled'",
                         param="thinking.budget_tokens")
    return kind != "disabled"


def _stop_sequences(fields: RequestFields) -> list[str]:
    return [s for s in request_fields.string_list(fields, "stop_sequences",
                                                  MAX_STOP_STRINGS) if s]


def _sampling(fields: RequestFields) -> Sampling:
    """Anthropic's three samplers, in its ranges; the rest at the pool's
    defaults (``Sampling``)."""
    given = {
        "temperature": fields.real("temperature", 0, 1),
        "top_p": fields.real("top_p", 0, 1),
        "top_k": fields.number("top_k", 0, None, integer=True),
    }
    return Sampling(**{k: v for k, v in given.items() if v is not None})


def _max_tokens(fields: RequestFields) -> int:
    value = fields.get("max_tokens")
    if value is None:
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("'max_tokens' must be an integer >= 1",
                         param="max_tokens")
    return value


def output_grammar(fields: RequestFields, tools: ToolRequest) -> str:
    """``output_config.format``: a JSON schema the answer must match, made a
    grammar by the machinery chat's ``response_format`` uses. ``effort``
    steers Anthropic's reasoning, which this model has not: refused."""
    config = fields.get("output_config")
    if config is None:
        return ""
    config = object_with(config, frozenset({"format"}), "output_config")
    fmt = config.get("format")
    if fmt is None:
        return ""
    fmt = object_with(fmt, frozenset({"type", "schema"}), "output_config.format")
    schema = fmt.get("schema")
    if fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        raise BadRequest("output_config.format must be {\"type\": "
                         "\"json_schema\", \"schema\": {...}}",
                         param="output_config.format")
    if tools.force:
        raise BadRequest("a forced tool call ('tool_choice') cannot be combined "
                         "with 'output_config.format'", param="tool_choice")
    try:
        return model_code.schema_to_gbnf(schema)
    except model_code.GrammarError as exc:
        raise BadRequest(f"'output_config.format.schema': {exc}",
                         param="output_config.format.schema") from None


def _conversation(fields: RequestFields) -> tuple[list[ChatMessage],
                                                  ToolRequest, bool]:
    """What a message and a count read alike: the turns and the tools."""
    turns = chat_turns(fields.get("messages"), system_text(fields.get("system")))
    tools, single = tools_of(fields)
    return turns, tools, single


def parse_messages(body: Any) -> MessagesRequest:
    """``POST /v1/messages``."""
    fields = RequestFields(body)
    turns, tools, single = _conversation(fields)
    stops = _stop_sequences(fields)
    max_tokens = _max_tokens(fields)
    think = thinking(fields, max_tokens)
    generation = GenerationRequest(
        kind=CHAT,
        messages=turns,
        max_tokens=max_tokens,
        sampling=_sampling(fields),
        stop=stops,
        grammar=output_grammar(fields, tools),
        tools=json.dumps(tools.tools) if tools.active else "",
        force_call=tools.force,
        add_generation_prompt=not prefilled(turns),
        continue_final=prefilled(turns),
        # max_tokens is required here: only the samplers are left to a worker.
        defaulted=request_fields.left_out(fields, None),
    )
    stream = request_fields.stream(fields)
    model = request_fields.model(fields)
    fields.finish(POLICY)
    return MessagesRequest(generation, stream, model, tools=tools.active,
                           single_call=single, stop_sequences=tuple(stops),
                           thinking=think)


def parse_count(body: Any) -> tuple[GenerationRequest, bool | None]:
    """``POST /v1/messages/count_tokens``: the prompt a message with the
    same ``messages``, ``system``, ``tools`` and ``thinking`` would have."""
    fields = RequestFields(body)
    turns, tools, _ = _conversation(fields)
    think = thinking(fields)
    request_fields.model(fields)
    fields.finish(field_policy.FieldPolicy())
    return GenerationRequest(kind=CHAT, messages=turns, max_tokens=1, tools=(
        json.dumps(tools.tools) if tools.active else ""),
        add_generation_prompt=not prefilled(turns),
        continue_final=prefilled(turns)), think
