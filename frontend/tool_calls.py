"""Tool calling on the chat endpoint: ``tools``, ``tool_choice``, ``tool_calls``.

What "the template supports tools" means here: the chat prompt is rendered
by the GGUF's own Jinja template (``tokenizer.chat_template``, the default
chat format) and that template mentions ``tools``, so it renders the tool
list it is given. A named chat format, or a template that never reads
``tools``, would drop them silently: such a pool answers 400 instead
(``workers.model.prompting.ToolsUnsupported``, checked where the prompt is
rendered: the frontend's gate, or the worker).

The call format is the one the model's template teaches
(``protocol.tool_formats``: Hermes/Qwen ``<tool_call>``, Llama 3 JSON,
Mistral ``[TOOL_CALLS]``, and others): the worker reads it from the
template and names it on the job's FINAL frame, and the answer's text is
read in it here. Its calls become OpenAI's ``tool_calls``
(``finish_reason: "tool_calls"``); the text around them stays ``content``.
A template that mentions ``tools`` in no known format refuses them (400).

``tool_choice``:

* ``"none"``: the tools are not offered to the model; a normal answer (a
  template without tool support is fine then);
* ``"auto"`` (the default with tools): offered, and the model may call one;
* ``"required"``, or ``{"type": "function", "function": {"name": ...}}``: a
  grammar makes the output exactly one call, of any offered function or of
  the named one, with arguments that match its ``parameters`` schema. The
  worker writes it in the model's own format (``force_call`` on the job,
  ``workers.model.tool_grammar``); every schema is converted here first,
  so a bad one is a 400 before a slot is taken.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from frontend import model_code
from frontend.errors import BadRequest
from frontend.request_fields import RequestFields
from protocol import tool_formats
from protocol.payloads import HistoryCall

#: At most this many tools per request (OpenAI allows 128).
MAX_TOOLS = 128

#: The deepest JSON a call's arguments may nest, in the model's output or in
#: the client's history. Python's parser recurses once per level and raised
#: ``RecursionError`` (a 500, a cut stream) at about 1,000 (issue 29); the
#: check below counts without recursing, and the schemas a call must follow
#: nest at most ``workers.model.grammar.MAX_SCHEMA_DEPTH`` (32) anyway.
MAX_JSON_DEPTH = 128
#: A JSON string (its brackets are not counted), a bracket, or a quote that
#: opens no string: the text is not JSON from there on.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def tool_name(name: Any, where: str) -> str:
    """A tool's name, as every API here allows it; else a 400 naming ``where``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where} must be 1-64 letters, digits, '_', '.' or '-'",
                         param=where)
    return name


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools."""

    #: The tools as the template renders them (OpenAI's shape); empty: none.
    tools: list[dict]
    #: The call forced (``GenerationRequest.force_call``): "*" any tool, a
    #: tool's name, "" the model chooses.
    force: str = ""

    @property
    def active(self) -> bool:
        return bool(self.tools)


NO_TOOLS = ToolRequest([])


def _function(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadRequest(f"{where} must be {{\"type\": \"function\", ...}}",
                         param=where)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be an object",
                         param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, "
                         "'_', '.' or '-'", param=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema "
                         "object", param=f"{where}.function.parameters")
    return fn


def _chosen_name(choice: Any, names: list[str]) -> str | None:
    """The named function of ``tool_choice``; raise 400 if it is no tool."""
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                         param="tool_choice")
    if name not in names:
        raise BadRequest(f"'tool_choice' names {name[:64]!r}, which is not in "
                         "'tools'", param="tool_choice")
    return name


def check_schemas(functions: list[dict]) -> None:
    """Each function's ``parameters`` converted to a grammar once, so a
    schema the worker could not force is a 400 at the door."""
    for fn in functions:
        try:
            model_code.schema_to_gbnf(fn.get("parameters") or {"type": "object"})
        except model_code.GrammarError as exc:
            raise BadRequest(f"'tools': a function's parameters: {exc}",
                             param="tools") from None


def tool_request(body: RequestFields) -> ToolRequest:
    """``tools`` and ``tool_choice`` of a chat body, checked."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise BadRequest("'functions' is OpenAI's deprecated form; use 'tools'",
                         param="functions")
    return offered_tools(body.get("tools"), body.get("tool_choice"))


def offered_tools(tools: Any, choice: Any) -> ToolRequest:
    """``tools`` and ``tool_choice`` in chat's shape, checked: the other APIs
    (``frontend.anthropic_schema``, ``frontend.responses_schema``) check
    their own shapes and hand them over in this one."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return NO_TOOLS
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools",
                         param="tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [fn["name"] for fn in functions]
    if choice == "none":
        return NO_TOOLS  # answered without offering them
    if choice in (None, "auto"):
        return ToolRequest(tools)
    if choice == "required":
        check_schemas(functions)
        return ToolRequest(tools, "*")
    if not isinstance(choice, dict):
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or a "
                         "function", param="tool_choice")
    name = _chosen_name(choice, names)
    check_schemas([f for f in functions if f["name"] == name])
    return ToolRequest(tools, name)


class TooDeep(ValueError):
    """JSON nested deeper than ``MAX_JSON_DEPTH``."""


def json_depth(text: str) -> int:
    """How deep the brackets of JSON ``text`` nest, outside its strings,
    counted without recursion (for a text that is not JSON, a number that
    need not mean anything)."""
    depth = deepest = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token == '"':
            # An unterminated string: a parser stops there, and scanning on
            # from each later quote would cost the square of the length.
            break
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def loads_shallow(text: str):
    """``json.loads`` of text that nests at most ``MAX_JSON_DEPTH`` deep.

    Raises:
        TooDeep: deeper (before any parsing, which would recurse).
        ValueError: not JSON.
    """
    if json_depth(text) > MAX_JSON_DEPTH:
        raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH}")
    return json.loads(text)


def split_calls(text: str, tool_format: str = "") -> tuple[str | None, list[dict]]:
    """The answer's ``content`` and its ``tool_calls`` (OpenAI's shape), read
    in the call format the FINAL frame named (``protocol.tool_formats``).

    A call that is not a JSON object with a string ``name`` stays in the
    content, as the model wrote it: so does one nested deeper than
    ``MAX_JSON_DEPTH``. What the model wrote is no mistake of the client's,
    and a client of OpenAI's API expects an answer for it, never an error
    (OpenAI passes on even arguments that are not valid JSON): so it gets
    the text, and a stream still ends with ``[DONE]``.
    """
    content, found = tool_formats.by_name(tool_format).split(text, loads_shallow)
    if not found:
        return text, []
    calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
              "function": {"name": name, "arguments": arguments}}
             for name, arguments in found]
    return content.strip() or None, calls


def history_calls(calls: Any, where: str) -> list[HistoryCall]:
    """An assistant turn's earlier ``tool_calls`` (OpenAI's shape), checked,
    for the worker to render in the model's own call format. The tool's
    answer follows as a ``tool`` message."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list", param=where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        arguments = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise BadRequest(f"{where}[{i}] must be {{\"function\": {{\"name\": "
                             "..., \"arguments\": \"<JSON text>\"}}}}",
                             param=f"{where}[{i}]")
        tool_name(name, f"{where}[{i}].function.name")
        param = f"{where}[{i}].function.arguments"
        try:
            parsed = loads_shallow(arguments) if arguments.strip() else {}
        except TooDeep:
            raise BadRequest(f"{param} is JSON nested deeper than "
                             f"{MAX_JSON_DEPTH}", param=param) from None
        except ValueError:
            raise BadRequest(f"{param} is not JSON", param=param) from None
        call_id = call.get("id")
        out.append(HistoryCall(name, json.dumps(parsed, ensure_ascii=False),
                               call_id[:128] if isinstance(call_id, str) else ""))
    return out
