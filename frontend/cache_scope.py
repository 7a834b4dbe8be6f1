"""Whose cached prompts a request may reuse: its tenant (issue 29).

Workers keep prompt states and route by prefix fingerprints, and a prompt
that reuses a cached prefix answers with a higher ``cached_tokens`` (and
``timings.cache_n``), and sooner. Shared across API keys, that is an oracle:
key A could learn, token block by token block, whether key B had sent a
guessed system prompt. So reuse is scoped to a tenant:

* ``--cache-scope key`` (the default): each API key is its own tenant, when
  the pool has more than one key. With no key or one, every request is the
  same client and scoping would change nothing, so the pool shares.
* ``--cache-scope pool``: every key shares one cache, as before (more reuse
  across keys, which then can learn each other's prompts).
* A request's ``cache_salt`` (vLLM's field) narrows either scope: only
  requests with the same salt (and, per key, the same key) share.

The tenant id is a keyed hash, never the key: HMAC-SHA-256 over the key and
the salt, keyed by a digest of the pool's whole key set, cut to 128 bits.
Every frontend that loads the same keys makes the same ids, so reuse and
routing hold across frontends and hosts; the broker and workers, which see
only ids, cannot test guesses of a key without every key. The id travels as
``GenerationRequest.cache_tenant`` and is checked by the worker before any
reuse (``workers.model.prompt_reuse``); fingerprints are in its scope
(``protocol.prefix``).
"""

from __future__ import annotations

import hashlib
import hmac

#: ``--cache-scope`` values.
KEY = "key"
POOL = "pool"
SCOPES = (KEY, POOL)

#: Hex digits of a tenant id (128 bits; ``protocol.limits.MAX_ID_CHARS`` caps
#: it on the wire).
TENANT_HEX_CHARS = 32

_DOMAIN = b"llamapool cache tenant v1"


def _framed(*parts: bytes) -> bytes:
    # Length-prefixed, so no key and salt pair reads as another.
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class CacheScope:
    """The tenant of a request from its key and salt (one per frontend).

    Args:
        scope: ``key`` or ``pool`` (``FrontendSettings.cache_scope``).
        api_keys: the pool's keys; their digest keys the hash.
        key_digests: the keys file's hashes (``key_records.startup_digests``).
    """

    def __init__(self, scope: str, api_keys: tuple[str, ...],
                 key_digests: tuple[bytes, ...] = ()) -> None:
        if scope not in SCOPES:
            raise ValueError(f"cache scope {scope!r} is not one of {SCOPES}")
        # A keys file's keys are known by their hashes only; those go into
        # the secret beside the plain keys.
        keys = sorted({_utf8(k) for k in api_keys} | {b"sha256:" + d for d in key_digests})
        #: Whether a key is its own tenant: only where there are several.
        self.per_key = scope == KEY and len(keys) > 1
        self._secret = hashlib.sha256(_framed(_DOMAIN, *keys)).digest()

    def tenant(self, key: str | None, salt: str = "") -> str:
        """The tenant id of a request made with ``key`` and ``salt`` ("" when
        neither scopes it: the pool's shared cache)."""
        parts = []
        if self.per_key and key:
            parts += [b"key", _utf8(key)]
        if salt:
            parts += [b"salt", _utf8(salt)]
        if not parts:
            return ""
        digest = hmac.new(self._secret, _framed(*parts), hashlib.sha256)
        return digest.hexdigest()[:TENANT_HEX_CHARS]

    def client(self, key: str | None) -> str:
        """The key as the broker's fair wait tells keys apart: the same
        keyed hash, of the key alone and whatever the cache scope ("" for no
        key), so every frontend names a key alike and the broker never
        sees it."""
        if not key:
            return ""
        digest = hmac.new(self._secret, _framed(b"client", _utf8(key)),
                          hashlib.sha256)
        return digest.hexdigest()[:TENANT_HEX_CHARS]
