"""KV-cache-aware routing through real processes: a prompt goes back to the
worker whose cache holds its prefix, and the cache is then really reused."""

from __future__ import annotations

import httpx
import pytest

from protocol.prefix import BLOCK_TOKENS, prefix_blocks, shared_blocks

pytestmark = pytest.mark.stack


def test_fingerprints_share_exactly_the_shared_blocks():
    a = list(range(100))
    b = list(range(70)) + [999] * 30
    assert len(prefix_blocks(a)) == 100 // BLOCK_TOKENS
    assert shared_blocks(prefix_blocks(a), prefix_blocks(b)) == 70 // BLOCK_TOKENS


def test_shared_prefix_goes_to_the_worker_that_has_it(whole_pool):
    url = whole_pool.url + "/v1/completions"
    first = "the quick brown fox and the lazy dog " * 12
    second = "hello world this is a test you say yes " * 12
    r1 = httpx.post(url, json={"prompt": first, "max_tokens": 2})
    r2 = httpx.post(url, json={"prompt": second, "max_tokens": 2})
    slot1, slot2 = r1.headers["X-Slot-Id"], r2.headers["X-Slot-Id"]
    assert slot1 != slot2  # least recently used spreads the two
    before = whole_pool.status()["counters"].get("routed_by_prefix", 0)
    # LRU alone would now pick slot1; the prefix says slot2.
    r3 = httpx.post(url, json={"prompt": second + "and more", "max_tokens": 2})
    assert r3.headers["X-Slot-Id"] == slot2
    usage = r3.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK_TOKENS
    assert whole_pool.status()["counters"]["routed_by_prefix"] == before + 1
