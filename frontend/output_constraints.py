"""``response_format``, ``json_schema`` and ``grammar``: one GBNF, or none.

Read as llama.cpp's server reads them (``tools/server/server-common.cpp``):
``response_format`` is ``{"type": "text"}``, ``{"type": "json_object"}``
(optionally with a ``schema``) or ``{"type": "json_schema", "json_schema":
{"schema": ...}}``; the native ``json_schema`` is a schema and ``grammar`` is
GBNF text; a schema and a grammar together are refused. A schema becomes GBNF
with llama-cpp-python's converter, and the GBNF is checked with llama.cpp's
parser, here, before a slot is taken (``workers.model.grammar``). Every
refusal is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from frontend import model_code
from frontend.errors import BadRequest
from frontend.request_fields import RequestFields

#: ``response_format.type`` values, as OpenAI and llama.cpp name them.
RESPONSE_TYPES = ("text", "json_object", "json_schema")


def _schema_of_response_format(fmt: Any) -> tuple[Any, str] | None:
    """(schema, param) from ``response_format``; None for plain text."""
    if not isinstance(fmt, dict):
        raise BadRequest("'response_format' must be an object",
                         param="response_format")
    kind = fmt.get("type")
    if kind not in RESPONSE_TYPES:
        raise BadRequest(
            "'response_format.type' must be one of "
            f"{', '.join(RESPONSE_TYPES)}; got {str(kind)[:40]!r}",
            param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return fmt.get("schema") or {"type": "object"}, "response_format.schema"
    wrapper = fmt.get("json_schema")
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise BadRequest(
            "'response_format.json_schema' must be an object with a 'schema'",
            param="response_format.json_schema")
    return wrapper["schema"], "response_format.json_schema.schema"


def grammar_of(body: RequestFields) -> str:
    """The GBNF the output must match, or "" for free text."""
    schema, param = None, None
    if body.get("json_schema") is not None:
        schema, param = body["json_schema"], "json_schema"
    if body.get("response_format") is not None:
        found = _schema_of_response_format(body["response_format"])
        if found is not None:
            if schema is not None:
                raise BadRequest("'response_format' and 'json_schema' cannot "
                                 "both be given", param="response_format")
            schema, param = found
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise BadRequest("'grammar' must be a string (GBNF)", param="grammar")
    if grammar and schema is not None:
        raise BadRequest("cannot use both a JSON schema and 'grammar'",
                         param="grammar")
    try:
        if schema is not None:
            return model_code.schema_to_gbnf(schema)
        if grammar:
            model_code.check_gbnf(grammar)
            return grammar
    except model_code.GrammarError as exc:
        raise BadRequest(f"'{param or 'grammar'}': {exc}",
                         param=param or "grammar") from None
    return ""
