"""The grammar of a forced tool call (``tool_choice`` required or named), in
the model's own call format (``protocol.tool_formats``).

Each offered function is one alternative: the format's text before the
arguments (its name written in), the arguments as its ``parameters``
schema allows them (llama-cpp-python's JSON-schema converter, its rules
renamed ``f<i>-...`` so that the functions' rules never collide), and the
format's text after them. The frontend has already converted every schema
once at the door, so a bad one was a 400 before it took a slot.
"""

from __future__ import annotations

import json
import re

from protocol.tool_formats import ToolFormat
from workers.model.grammar import schema_to_gbnf

#: A string literal, a character class, a repetition count, or a rule name:
#: only rule names are renamed.
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\{[0-9, ]*\}'
                         r"|[A-Za-z][A-Za-z0-9_-]*")


def _renamed(gbnf: str, prefix: str) -> str:
    def rename(match: re.Match) -> str:
        token = match.group()
        return prefix + token if token[0].isalpha() else token
    return _GBNF_TOKEN.sub(rename, gbnf)


def call_grammar(tool_format: ToolFormat, tools_json: str, force: str) -> str:
    """GBNF for exactly one call, of any offered tool (``force`` "*") or of
    the named one.

    Raises:
        ValueError: the tools are not OpenAI's list, or ``force`` names none
            of them (the frontend checked both; a peer might not have).
        GrammarError: a schema the converter cannot take.
    """
    tools = json.loads(tools_json) if tools_json else []
    functions = [t.get("function") for t in tools if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f, dict)
                 and isinstance(f.get("name"), str)]
    if force != "*":
        functions = [f for f in functions if f["name"] == force]
    if not functions:
        raise ValueError(f"the forced call names no offered tool ({force[:64]!r})")
    rules, alternatives = [], []
    for i, fn in enumerate(functions):
        params = fn.get("parameters") or {"type": "object"}
        prefix = f"f{i}-"
        rules.append(_renamed(schema_to_gbnf(params), prefix))
        before, after = tool_format.around(fn["name"])
        parts = [json.dumps(before)] if before else []
        parts.append(prefix + "root")
        if after:
            parts.append(json.dumps(after))
        alternatives.append(" ".join(parts))
    return "root ::= " + " | ".join(f"({a})" for a in alternatives) + "\n" + \
        "\n".join(rules)
