"""The tool-call formats chat templates teach, read from the template.

A model calls a tool by writing text in the form its chat template taught
it. The worker reads the form from the GGUF's template (``detect``), writes
a forced call's grammar in it and earlier calls back in it, and names it on
the job's FINAL frame (``Final.tool_format``); the frontend parses the
answer with the same format (``frontend.tool_calls``). So this catalogue is
shared by both sides, and imports nothing but the standard library.

The formats, as llama.cpp's ``common/chat.cpp`` reads them:

* ``hermes`` (Hermes 2 Pro, Qwen 2.5/3): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, once per call;
* ``llama3`` (Llama 3.1-3.3): the answer is a JSON object ``{"name": ...,
  "parameters": {...}}`` (``arguments`` read too), maybe after
  ``<|python_tag|>``; several are separated by ``;``;
* ``mistral`` (Mistral v3, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]``;
* ``mistral-v11`` (Magistral, Devstral, Mistral Small 3.2):
  ``[TOOL_CALLS]name[ARGS]{...}``, once per call (``[CALL_ID]id`` may sit
  before ``[ARGS]``);
* ``command-r7b``: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name":
  ..., "parameters": {...}}]<|END_ACTION|>``;
* ``functionary-v3.1``: ``<function=name>{...}</function>``;
* ``deepseek-r1``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
  <｜tool▁sep｜>name`` then the arguments in a json code block, then
  ``<｜tool▁call▁end｜>`` and ``<｜tool▁calls▁end｜>``.

A template that mentions ``tools`` but teaches none of these has no known
format: tools are refused there (``ToolsUnsupported``), as before any
format was known, never parsed in a guessed one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

#: One call as the parsers give it: the function's name and its arguments
#: as JSON text (OpenAI's ``function.arguments``).
Call = tuple[str, str]
#: A JSON loader (``frontend.tool_calls.loads_shallow`` bounds the depth).
Loader = Callable[[str], object]


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One format: how a call is written and how an answer is read."""

    name: str
    #: A call's text before and after its arguments (JSON text), for
    #: writing one (a grammar forcing one, a call in the history).
    around: Callable[[str], tuple[str, str]]
    #: The answer's content (the text around the calls) and its calls; a
    #: call that cannot be read stays in the content as written.
    split: Callable[[str, Loader], tuple[str, list[Call]]]
    #: The format's marker strings. Where one is a control token of the
    #: model's vocabulary (Mistral's ``[TOOL_CALLS]``, Llama's
    #: ``<|python_tag|>``), the worker writes its text into the answer
    #: when tools were offered (as llama-server's preserved tokens), or the
    #: parser would never see it.
    markers: tuple[str, ...] = ()

    def write(self, name: str, arguments: str) -> str:
        before, after = self.around(name)
        return before + arguments + after


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _call_of(obj: object, name_key: str, args_keys: tuple[str, ...]
             ) -> Call | None:
    """A call from a parsed JSON object, or None if it is none."""
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    arguments = next((obj[k] for k in args_keys if k in obj), {})
    text = arguments if isinstance(arguments, str) else json.dumps(
        arguments, ensure_ascii=False)
    return obj[name_key], text


def _blocks(pattern: re.Pattern, read: Callable[[re.Match, Loader], list[Call]]):
    """A splitter for formats that wrap calls in markers: each match of
    ``pattern`` read by ``read`` (an empty list: not a call, kept as text)."""

    def split(text: str, loads: Loader) -> tuple[str, list[Call]]:
        calls, kept, at = [], [], 0
        for match in pattern.finditer(text):
            try:
                found = read(match, loads)
            except ValueError:  # not JSON, or nested too deep
                continue
            if not found:
                continue
            kept.append(text[at:match.start()])
            at = match.end()
            calls += found
        kept.append(text[at:])
        return "".join(kept), calls

    return split


def _json_call(name_key: str, *args_keys: str, group: int = 1):
    def read(match: re.Match, loads: Loader) -> list[Call]:
        call = _call_of(loads(match.group(group)), name_key, args_keys)
        return [call] if call else []
    return read


def _json_array(name_key: str, *args_keys: str):
    def read(match: re.Match, loads: Loader) -> list[Call]:
        items = loads(match.group(1))
        if not isinstance(items, list) or not items:
            return []
        calls = [_call_of(item, name_key, args_keys) for item in items]
        return [] if None in calls else calls
    return read


def _named_args(match: re.Match, loads: Loader) -> list[Call]:
    """A call whose name is outside its JSON arguments (group 1: the name,
    group 2: the arguments)."""
    arguments = match.group(2)
    loads(arguments)  # raises if it is no JSON
    return [(match.group(1), arguments)]


# --- the formats ------------------------------------------------------------------

HERMES = ToolFormat(
    "hermes",
    lambda name: (f'<tool_call>{{"name": {_q(name)}, "arguments": ', "}</tool_call>"),
    _blocks(re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL),
            _json_call("name", "arguments", "parameters")),
    ("<tool_call>", "</tool_call>"))

_PYTHON_TAG = "<|python_tag|>"


def _llama3_split(text: str, loads: Loader) -> tuple[str, list[Call]]:
    """The whole answer is the call(s): JSON objects, ``;`` between them,
    maybe after ``<|python_tag|>``. JSON inside prose is prose."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    # A ';' inside a string splits wrongly: that piece is no JSON, and the
    # answer stays text, as for any call that cannot be read.
    pieces = re.split(r"(?<=\})\s*;\s*(?=\{)", body)
    calls = []
    for piece in pieces:
        try:
            call = _call_of(loads(piece), "name", ("parameters", "arguments"))
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


LLAMA3 = ToolFormat(
    "llama3",
    lambda name: (f'{{"name": {_q(name)}, "parameters": ', "}"),
    _llama3_split, (_PYTHON_TAG,))

MISTRAL = ToolFormat(
    "mistral",
    lambda name: (f'[TOOL_CALLS][{{"name": {_q(name)}, "arguments": ', "}]"),
    _blocks(re.compile(r"\[TOOL_CALLS\]\s*(\[.*\])", re.DOTALL),
            _json_array("name", "arguments", "parameters")),
    ("[TOOL_CALLS]",))

#: The arguments of a ``[TOOL_CALLS]name[ARGS]{...}`` call run to the next
#: call or the end: JSON objects cannot be matched by a regular expression,
#: and the loader checks what was taken.
MISTRAL_V11 = ToolFormat(
    "mistral-v11",
    lambda name: (f"[TOOL_CALLS]{name}[ARGS]", ""),
    # Whitespace may follow a marker: an SPM vocabulary writes a word after
    # a control token with its leading space.
    _blocks(re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]{1,64})"
                       r"(?:\[CALL_ID\]\s*[A-Za-z0-9]*)?\[ARGS\]"
                       r"(.*?)(?=\[TOOL_CALLS\]|\s*$)", re.DOTALL),
            _named_args),
    ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))

COMMAND_R7B = ToolFormat(
    "command-r7b",
    lambda name: (f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": '
                  f'{_q(name)}, "parameters": ', "}]<|END_ACTION|>"),
    _blocks(re.compile(r"<\|START_ACTION\|>\s*(.*?)\s*<\|END_ACTION\|>", re.DOTALL),
            _json_array("tool_name", "parameters", "arguments")),
    ("<|START_ACTION|>", "<|END_ACTION|>"))

FUNCTIONARY_V3_1 = ToolFormat(
    "functionary-v3.1",
    lambda name: (f"<function={name}>", "</function>"),
    _blocks(re.compile(r"<function=([A-Za-z0-9_.-]{1,64})>\s*(.*?)\s*</function>",
                       re.DOTALL), _named_args))

_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_SEP, _DS_CALL_END = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                   "<｜tool▁call▁end｜>")


def _deepseek_split(text: str, loads: Loader) -> tuple[str, list[Call]]:
    """Calls inside one ``tool▁calls`` section; the text before it is the
    content."""
    section = re.search(re.escape(_DS_CALLS) + r"(.*?)(?:" + re.escape(_DS_CALLS_END)
                        + r"|$)", text, re.DOTALL)
    if section is None:
        return text, []
    one = re.compile(re.escape(_DS_CALL) + r"function" + re.escape(_DS_SEP)
                     + r"([A-Za-z0-9_.-]{1,64})\s*```(?:json)?\s*(.*?)\s*```\s*"
                     + re.escape(_DS_CALL_END), re.DOTALL)
    content, calls = _blocks(one, _named_args)(section.group(1), loads)
    if not calls or content.strip():
        return text, []  # a section that is not all calls is left as text
    return text[:section.start()] + text[section.end():], calls


DEEPSEEK_R1 = ToolFormat(
    "deepseek-r1",
    lambda name: (f"{_DS_CALLS}{_DS_CALL}function{_DS_SEP}{name}\n```json\n",
                  f"\n```{_DS_CALL_END}{_DS_CALLS_END}"),
    _deepseek_split, (_DS_CALLS, _DS_CALLS_END, _DS_CALL, _DS_SEP, _DS_CALL_END))

FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, MISTRAL_V11, COMMAND_R7B,
                               FUNCTIONARY_V3_1, DEEPSEEK_R1)}


def detect(template: str) -> ToolFormat | None:
    """The format ``template`` teaches, by the markers llama.cpp's
    ``common/chat.cpp`` looks for; None: none known (or no tools at all).
    The more specific markers are looked at first: a Qwen3-Coder template
    has ``<tool_call>`` but calls in XML (``<function=...><parameter=...>``),
    which is not one of these."""
    if "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template:
        return MISTRAL_V11 if "[ARGS]" in template else MISTRAL
    if "<|START_ACTION|>" in template:
        return COMMAND_R7B
    if _DS_CALLS in template:
        return DEEPSEEK_R1
    if "<parameter=" in template:
        return None  # Qwen3-Coder's XML calls
    if "<tool_call>" in template:
        return HERMES
    if "<function=" in template:
        return FUNCTIONARY_V3_1
    if "<|start_header_id|>" in template and ("ipython" in template
                                              or '"parameters"' in template):
        return LLAMA3
    return None


def by_name(name: str) -> ToolFormat:
    """The format a FINAL frame names; "" (a worker from before formats, or
    an engine with no template) is the one format there was, ``hermes``."""
    return FORMATS.get(name or HERMES.name, HERMES)
