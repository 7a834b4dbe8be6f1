"""Prompt-prefix fingerprints for KV-cache-aware routing.

A prompt's tokens are cut into blocks of ``BLOCK_TOKENS``; block ``i``'s
fingerprint is a running CRC32 over blocks ``0..i``, so two prompts share
their first ``k`` fingerprints exactly when they share their first ``k``
blocks of tokens (up to CRC collisions, which only cost a worse route).
The broker compares fingerprint lists without knowing any tokens.
"""

from __future__ import annotations

import array
import zlib

BLOCK_TOKENS = 32
#: A prompt longer than this many blocks is fingerprinted up to here only.
MAX_BLOCKS = 128


def prefix_blocks(tokens: list[int]) -> list[int]:
    """Running fingerprints of each complete block of ``tokens``."""
    out: list[int] = []
    crc = 0
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
