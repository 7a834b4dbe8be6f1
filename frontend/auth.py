"""API keys, as llama.cpp's server does them.

A key is accepted in ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``.
The public paths below need none. Keys are compared in constant time and
never logged; only the last four characters of the first key are, at startup.
A keys file (``frontend.key_records``) adds named keys, known by their hash;
such a key shows as its name.
"""

from __future__ import annotations

import hmac
import logging

from frontend.errors import Unauthorized
from frontend.key_records import KeyRecords
from frontend.probes import PROBE_PATHS
from frontend.web_page import PUBLIC_PAGE_PATHS

log = logging.getLogger("llamapool.frontend")

#: ``/``, ``/index.html``, ``/bundle.js``, ``/bundle.css`` and the page's other
#: modules are among ``PUBLIC_PAGE_PATHS`` (``frontend.web_page``); a kubelet
#: sends no key, so ``/livez`` and ``/readyz`` are public (``frontend.probes``).
PUBLIC_PATHS = frozenset(
    {"/health", "/v1/health", "/models", "/v1/models"}
) | PUBLIC_PAGE_PATHS | PROBE_PATHS


def key_suffix(key: str | None) -> str:
    """What may be shown of a key: its last 4 characters."""
    return key[-4:] if key else "-"


def presented_key(headers_get) -> str | None:
    """The key a request carries, from either header (Bearer wins)."""
    auth = headers_get("AUTHORIZATION")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = headers_get("X-API-KEY")
    return api_key.strip() if api_key else None


def key_is_valid(candidate: str, keys: tuple[str, ...]) -> bool:
    """Constant time in the candidate: every key is compared, no early exit."""
    candidate_bytes = candidate.encode("utf-8", "surrogateescape")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(candidate_bytes, key.encode("utf-8"))
    return ok


class ApiKeyMiddleware:
    """Rejects requests to protected paths without a valid key (HTTP 401)."""

    def __init__(self, keys: tuple[str, ...],
                 records: KeyRecords | None = None) -> None:
        self.keys = keys
        self.records = records

    def process_request(self, req, resp) -> None:
        req.context.key_suffix = "-"
        req.context.key_record = None
        # OPTIONS: a browser's CORS preflight never carries the key, and the
        # answer is only the route's methods (``frontend.cors``), as in llama.cpp.
        if (not self.keys and self.records is None) or req.path in PUBLIC_PATHS \
                or req.method == "OPTIONS":
            return
        candidate = presented_key(req.get_header)
        if candidate is None:
            raise Unauthorized()
        record = self.records.lookup(candidate) if self.records is not None else None
        if record is None and not key_is_valid(candidate, self.keys):
            raise Unauthorized()
        # A named key is its name in logs (and at the broker); another key,
        # what may be shown of it.
        req.context.key_record = record
        req.context.key_suffix = record.name if record else key_suffix(candidate)
