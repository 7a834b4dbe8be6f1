"""Prompt-prefix fingerprints for KV-cache-aware routing.

A prompt's tokens are cut into blocks of ``BLOCK_TOKENS``; block ``i``'s
fingerprint is a running CRC32 over blocks ``0..i``, so two prompts share
their first ``k`` fingerprints exactly when they share their first ``k``
blocks of tokens (up to CRC collisions, which only cost a worse route).
The broker compares fingerprint lists without knowing any tokens.

Fingerprints are scoped to a tenant (``GenerationRequest.cache_tenant``: a
keyed hash of the API key and the request's ``cache_salt``, made by the
frontend, ``frontend.cache_scope``): the running CRC starts from the tenant's
own, so two tenants' lists for the same tokens share nothing and the broker
never routes one tenant's prompt to a worker for another tenant's prefix.
The empty tenant (the pool's shared scope) starts from 0, as before there
were tenants.
"""

from __future__ import annotations

import array
import zlib

BLOCK_TOKENS = 32
#: A prompt longer than this many blocks is fingerprinted up to here only.
MAX_BLOCKS = 128


def prefix_blocks(tokens: list[int], tenant: str = "") -> list[int]:
    """Running fingerprints of each complete block of ``tokens``, in
    ``tenant``'s scope ("" : the pool's shared one)."""
    out: list[int] = []
    crc = zlib.crc32(tenant.encode("utf-8", "surrogateescape")) if tenant else 0
    n_blocks = min(len(tokens) // BLOCK_TOKENS, MAX_BLOCKS)
    for i in range(n_blocks):
        block = array.array("i", tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        crc = zlib.crc32(block.tobytes(), crc)
        out.append(crc)
    return out


def shared_blocks(a: list[int], b: list[int]) -> int:
    """How many leading fingerprints two lists have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
