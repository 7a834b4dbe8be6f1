"""Reading a request's JSON body: bounded in size, depth and values.

The body is read with or without a Content-Length (chunked), never beyond
the limit. Everything a client sends is parsed here before any field is
looked at, so
the hostile shapes that would otherwise surface deep inside as a 500 are
refused at the door with a 400 that names the field:

* JSON nested deeper than the parser's recursion limit (``RecursionError``);
* integers beyond what the wire can carry (msgpack holds 64 bits; 10**400
  would fail only when the SUBMIT is encoded, after a slot was asked for);
* strings with lone UTF-16 surrogates (``"\\ud800"`` is valid JSON but no
  UTF-8 can encode it, so msgpack and llama.cpp's tokenizer would fail).
"""

from __future__ import annotations

import json
import re

import falcon

from frontend.errors import BadRequest, PayloadTooLarge

#: A JSON escape that may stand for a UTF-16 surrogate (D800-DFFF).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

#: The widest integers the wire (msgpack) carries.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1


class _IntegerOutOfRange(ValueError):
    def __init__(self, text: str) -> None:
        super().__init__(f"{text[:20]}{'...' if len(text) > 20 else ''}")


def _bounded_int(text: str) -> int:
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise _IntegerOutOfRange(text)
    return value


def read_json_body(req: falcon.Request, limit_bytes: int):
    """The parsed JSON body, enforcing the size limit before parsing.

    Raises:
        PayloadTooLarge: over ``limit_bytes``.
        BadRequest: not JSON, not UTF-8, too deep, an integer out of range
            (naming its field), or a lone surrogate in a string (naming it).
    """
    if req.content_length is not None and req.content_length > limit_bytes:
        raise PayloadTooLarge(
            f"the body is {req.content_length} bytes; the limit is {limit_bytes}"
        )
    raw = _read_at_most(req, limit_bytes + 1)
    if len(raw) > limit_bytes:
        raise PayloadTooLarge(f"the body is over the limit of {limit_bytes} bytes")
    try:
        body = json.loads(raw, parse_int=_bounded_int)
    except UnicodeDecodeError:
        raise BadRequest("the body is not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except _IntegerOutOfRange:
        # Parse again, keeping the huge integers, to name the field.
        where = _find(json.loads(raw), lambda v: isinstance(v, int)
                      and not isinstance(v, bool) and not INT_MIN <= v <= INT_MAX)
        raise BadRequest(f"'{where}' is an integer out of range", param=where
                         ) from None
    except ValueError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    # A body that is valid UTF-8 holds a surrogate only as a ``\uD800``-
    # ``\uDFFF`` escape: without one (nearly every body) there is nothing
    # to look for. A false match (an escaped backslash before "ud8") only
    # costs the walk.
    where = _find(body, _has_surrogate) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise BadRequest(f"'{where}' has a lone UTF-16 surrogate, which no text "
                         "can hold", param=where)
    return body


def _read_at_most(req: falcon.Request, limit_bytes: int) -> bytes:
    """Up to ``limit_bytes`` of the body, with or without a Content-Length.

    falcon's ``bounded_stream`` trusts Content-Length and reads nothing without
    it; a chunked body has none. The WSGI server (gunicorn) decodes the chunks
    and ends ``wsgi.input`` at the last one, so it is read directly, in steps,
    and never beyond the limit.
    """
    if req.content_length is not None or not req.get_header("Transfer-Encoding"):
        return req.bounded_stream.read(limit_bytes)
    parts: list[bytes] = []
    left = limit_bytes
    while left > 0:
        part = req.stream.read(min(left, 65536))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _has_surrogate(value) -> bool:
    if not isinstance(value, str) or value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find(body, bad) -> str | None:
    """The path (``messages[0].content``) of the first value ``bad`` accepts.

    Iterative, so a body just under the parser's depth limit cannot exhaust
    the stack here. Object keys are checked as values at their own path.
    """
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if bad(value):
            return path or "(body)"
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                child = f"{path}.{key}" if path else str(key)
                if bad(key):
                    return child
                stack.append((child, item))
        elif isinstance(value, list):
            for i in reversed(range(len(value))):
                stack.append((f"{path}[{i}]", value[i]))
    return None
