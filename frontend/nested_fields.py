"""Objects nested in a request body (a message, a content block, a tool),
read as strictly as the body: a key no reader knows is refused, by name.

``frontend.request_fields`` reads a body's top-level fields and refuses
those no reader read; these readers do the same one level down, for the
Anthropic and Responses parsers, whose requests nest most of what they say.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import BadRequest


def object_with(obj: Any, allowed: frozenset[str], where: str) -> dict:
    """``obj`` as an object whose keys (those not null) are all in ``allowed``."""
    if not isinstance(obj, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    unknown = next((k for k in obj if k not in allowed and obj[k] is not None),
                   None)
    if unknown is not None:
        raise BadRequest(f"{where}.{str(unknown)[:60]} is not supported",
                         param=f"{where}.{str(unknown)[:60]}")
    return obj


def string_in(obj: dict, key: str, where: str) -> str:
    """``obj[key]``, which must be a string."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value
