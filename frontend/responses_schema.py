"""OpenAI's Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``),
stateless, read into the chat job every other chat endpoint submits.

Nothing is stored: ``store: true``, ``previous_response_id``,
``conversation`` and ``background: true`` get a 400 that says so, and a
client sends the whole conversation in ``input`` each time (as Codex does
with ``store: false``).

``input`` becomes chat turns rendered by the model's own template, so it
gets the same prompt gate, prefix routing and prompt-state cache as
``/v1/chat/completions``:

* ``instructions`` is the first system turn; a ``developer`` message is a
  system turn too (GGUF templates know ``system``, few know ``developer``);
* ``function_call`` items go back as calls of the assistant turn
  (``frontend.tool_calls.history_calls``; the worker renders them in the
  call form the model was taught), on the assistant turn
  they follow; each ``function_call_output`` is a ``tool`` turn;
* ``reasoning`` items of earlier turns are accepted and not shown to the
  model again (reasoning templates drop earlier reasoning too);
  ``encrypted_content`` is refused, since only OpenAI can read it.

``tools`` of type ``function`` and ``tool_choice`` become chat's
(``offered_tools``); any other tool type is a 400 naming it. ``text.format``
with a JSON schema is a grammar, made by the machinery chat's
``response_format`` uses.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from frontend import model_code, request_fields
from frontend.errors import BadRequest
from frontend.field_policy import FieldPolicy
from frontend.nested_fields import object_with, string_in
from frontend.request_fields import RequestFields
from frontend.tool_calls import ToolRequest, history_calls, offered_tools, tool_name
from protocol.payloads import CHAT, ChatMessage, GenerationRequest, Sampling

#: Labels of a request, and OpenAI's cache and capacity hints: none changes
#: an answer here (README). ``prompt_cache_key`` is a routing hint for
#: OpenAI's cache; the pool routes by the prompt's own prefix.
POLICY = FieldPolicy(frozenset({"metadata", "user", "service_tier",
                                "safety_identifier", "prompt_cache_key"}),
                     no_op_values={"truncation": ("disabled",),
                                   "background": (False,),
                                   "store": (False,)})

STATELESS = ("this server is stateless: it stores no response, so {field} "
             "cannot be used; send the whole conversation in 'input'")


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    """A checked ``/v1/responses`` body; ``generation`` goes to a worker."""

    generation: GenerationRequest
    stream: bool
    model: str | None
    #: Tools were offered: the answer is searched for calls.
    tools: bool = False
    #: ``parallel_tool_calls: false``: at most one call is answered.
    single_call: bool = False
    #: What the response object echoes of the request.
    echo: dict = dataclasses.field(default_factory=dict)
    #: ``reasoning.effort``: ``none`` is off, any other on; None: not given.
    thinking: bool | None = None


_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal"}
_PART_KEYS = frozenset({"type", "text", "refusal", "annotations", "logprobs"})


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of parts",
                         param=where)
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise BadRequest(f"{at}: only text parts are supported (got "
                             f"{str(kind)[:40]!r})", param=at)
        part = object_with(part, _PART_KEYS, at)
        texts.append(string_in(part, _PART_TYPES[kind], at))
    return "".join(texts)


_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_REASONING_KEYS = frozenset({"type", "id", "summary", "content",
                             "encrypted_content", "status"})


class _Turns:
    """Chat turns being built from ``input`` items in order: calls join the
    assistant turn just before them."""

    def __init__(self, instructions: str) -> None:
        self.turns = [ChatMessage("system", instructions)] if instructions else []
        self._calls: list[dict] = []
        self._text = ""
        self._thought = ""

    def flush(self) -> None:
        if self._calls:
            self.turns.append(ChatMessage("assistant", self._text, self._thought,
                                          history_calls(self._calls, "input")))
        elif self._text or self._thought:
            self.turns.append(ChatMessage("assistant", self._text, self._thought))
        self._calls, self._text, self._thought = [], "", ""

    def message(self, item: dict, where: str) -> None:
        item = object_with(item, _MESSAGE_KEYS, where)
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise BadRequest(f"{where}.role must be one of {sorted(_ROLES)}",
                             param=f"{where}.role")
        text = _content(item.get("content"), f"{where}.content")
        if role == "assistant" and not self._text and not self._calls:
            self._text = text  # the turn a reasoning item began
            return
        self.flush()
        if role == "assistant":
            self._text = text
        else:
            self.turns.append(ChatMessage(role, text))

    def call(self, item: dict, where: str) -> None:
        item = object_with(item, _CALL_KEYS, where)
        string_in(item, "call_id", where)
        self._calls.append({"function": {"name": string_in(item, "name", where),
                                         "arguments": string_in(item, "arguments",
                                                              where)}})

    def output(self, item: dict, where: str) -> None:
        item = object_with(item, _OUTPUT_KEYS, where)
        string_in(item, "call_id", where)
        self.flush()
        self.turns.append(ChatMessage("tool", _content(item.get("output"),
                                                       f"{where}.output")))

    def reasoning(self, item: dict, where: str) -> None:
        """Earlier reasoning: the reasoning of the assistant turn it begins
        (its ``content`` text, else its summary's)."""
        item = object_with(item, _REASONING_KEYS, where)
        if item.get("encrypted_content"):
            raise BadRequest(f"{where}.encrypted_content: encrypted reasoning "
                             "is OpenAI's and cannot be read here",
                             param=f"{where}.encrypted_content")
        texts = []
        for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise BadRequest(f"{where}.{key} must be a list",
                                 param=f"{where}.{key}")
            for i, part in enumerate(parts):
                at = f"{where}.{key}[{i}]"
                part = object_with(part, frozenset({"type", "text"}), at)
                if part.get("type") != kind:
                    raise BadRequest(f"{at}.type must be {kind!r}",
                                     param=f"{at}.type")
                texts.append(string_in(part, "text", at))
            if texts:
                break
        self.flush()
        self._thought = "\n".join(texts)


def chat_turns(raw: Any, instructions: str) -> list[ChatMessage]:
    """``input`` (and ``instructions``) as chat turns."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'input' must be a string or a non-empty list of items",
                         param="input")
    turns = _Turns(instructions)
    readers = {"message": turns.message, "function_call": turns.call,
               "function_call_output": turns.output,
               "reasoning": turns.reasoning}
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind not in readers:
            raise BadRequest(f"{where}.type {str(kind)[:60]!r} is not supported: "
                             f"items are {', '.join(readers)}",
                             param=f"{where}.type")
        readers[kind](item, where)
    turns.flush()
    if not any(t.role in ("user", "tool") for t in turns.turns):
        raise BadRequest("'input' has no user message", param="input")
    return turns.turns


_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        # Hosted tools (web_search, file_search, code_interpreter, mcp...)
        # run at OpenAI; llama.cpp refuses them without saying which.
        raise BadRequest(f"{where}.type {str(kind)[:60]!r} is not supported: "
                         "only tools of type 'function'", param=f"{where}.type")
    tool = object_with(tool, _TOOL_KEYS, where)
    name = tool_name(tool.get("name"), f"{where}.name")
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}.parameters must be a JSON schema object",
                         param=f"{where}.parameters")
    fn = {"name": name, "parameters": params}
    if tool.get("description") is not None:
        fn["description"] = string_in(tool, "description", where)
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # "none", "auto", "required": chat's words
    choice = object_with(choice, frozenset({"type", "name"}), "tool_choice")
    if choice.get("type") != "function":
        raise BadRequest(f"tool_choice.type {str(choice.get('type'))[:60]!r} "
                         "is not supported: only 'function'",
                         param="tool_choice.type")
    return {"type": "function",
            "function": {"name": string_in(choice, "name", "tool_choice")}}


def tools_of(fields: RequestFields) -> ToolRequest:
    tools = fields.get("tools")
    choice = _tool_choice(fields.get("tool_choice"))
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    return offered_tools(None if tools is None
                         else [_tool(t, i) for i, t in enumerate(tools)], choice)


_FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})


def text_grammar(fields: RequestFields) -> str:
    """``text.format``: plain text, or a JSON object or schema (GBNF)."""
    text = fields.get("text")
    if text is None:
        return ""
    text = object_with(text, frozenset({"format"}), "text")
    fmt = text.get("format")
    if fmt is None:
        return ""
    fmt = object_with(fmt, _FORMAT_KEYS, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        schema, param = {"type": "object"}, "text.format"
    elif kind == "json_schema":
        schema, param = fmt.get("schema"), "text.format.schema"
        if not isinstance(schema, dict):
            raise BadRequest("text.format.schema must be a JSON schema object",
                             param=param)
    else:
        raise BadRequest("text.format.type must be 'text', 'json_object' or "
                         "'json_schema'", param="text.format.type")
    try:
        return model_code.schema_to_gbnf(schema)
    except model_code.GrammarError as exc:
        raise BadRequest(f"'{param}': {exc}", param=param) from None


def refuse_state(fields: RequestFields) -> None:
    """What a stateful server would read: refused, saying why."""
    for field in ("previous_response_id", "conversation"):
        if fields.get(field) is not None:
            raise BadRequest(STATELESS.format(field=f"'{field}'"), param=field)
    if fields.get("store") is True:
        raise BadRequest(STATELESS.format(field="'store: true'"), param="store")
    if fields.get("background") is True:
        raise BadRequest(STATELESS.format(field="'background: true'"),
                         param="background")
    include = fields.get("include")
    if include:
        raise BadRequest(f"'include' is not supported ({str(include)[:80]})",
                         param="include")


#: ``reasoning.effort`` values; ``none`` turns thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")


def reasoning(fields: RequestFields) -> bool | None:
    """``reasoning``: its ``effort`` switches a reasoning template's thinking
    (``none``: off); a degree of effort is not a setting a template has, and
    ``summary`` gets the reasoning itself (README)."""
    value = fields.get("reasoning")
    if value is None:
        return None
    value = object_with(value, frozenset({"effort", "summary"}), "reasoning")
    effort, summary = value.get("effort"), value.get("summary")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)}",
                         param="reasoning.effort")
    if summary is not None and summary not in SUMMARIES:
        raise BadRequest(f"reasoning.summary must be one of "
                         f"{', '.join(SUMMARIES)}", param="reasoning.summary")
    return None if effort is None else effort != "none"


def _conversation(fields: RequestFields) -> tuple[list[ChatMessage],
                                                  ToolRequest, str, bool]:
    """What a response and a count read alike."""
    refuse_state(fields)
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    turns = chat_turns(fields.get("input"), instructions or "")
    tools = tools_of(fields)
    grammar = text_grammar(fields)
    if tools.force and grammar:
        raise BadRequest("a forced tool call ('tool_choice') cannot be combined "
                         "with a JSON 'text.format'", param="tool_choice")
    parallel = fields.flag("parallel_tool_calls")
    return turns, tools, grammar, parallel is False



def _echo(fields: RequestFields) -> dict:
    """The request's settings as the response object repeats them."""
    body = {name: fields.get(name) for name in (
        "instructions", "max_output_tokens", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "text", "metadata")}
    defaults = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
                "text": {"format": {"type": "text"}}, "metadata": {},
                "temperature": 1.0, "top_p": 1.0}
    return {k: (defaults.get(k) if v is None else v) for k, v in body.items()}


def parse_responses(body: Any) -> ResponsesRequest:
    """``POST /v1/responses``."""
    fields = RequestFields(body)
    turns, tools, grammar, single = _conversation(fields)
    given = {"temperature": fields.real("temperature", 0, 2),
             "top_p": fields.real("top_p", 0, 1)}
    generation = GenerationRequest(
        kind=CHAT,
        messages=turns,
        max_tokens=fields.number("max_output_tokens", 1, None, integer=True),
        sampling=Sampling(**{k: v for k, v in given.items() if v is not None}),
        grammar=grammar,
        tools=json.dumps(tools.tools) if tools.active else "",
        force_call=tools.force,
        defaulted=request_fields.left_out(fields, ("max_output_tokens",)),
    )
    stream = request_fields.stream(fields)
    model = request_fields.model(fields)
    echo = _echo(fields)
    think = reasoning(fields)
    fields.finish(POLICY)
    return ResponsesRequest(generation, stream, model, tools=tools.active,
                            single_call=single and tools.active, echo=echo,
                            thinking=think)


def parse_input_tokens(body: Any) -> tuple[GenerationRequest, bool | None]:
    """``POST /v1/responses/input_tokens``: the prompt a response to the same
    ``input``, ``instructions``, ``tools`` and ``reasoning`` would have."""
    fields = RequestFields(body)
    turns, tools, _, _ = _conversation(fields)
    think = reasoning(fields)
    request_fields.model(fields)
    fields.finish(POLICY)
    return GenerationRequest(kind=CHAT, messages=turns, max_tokens=1, tools=(
        json.dumps(tools.tools) if tools.active else "")), think
