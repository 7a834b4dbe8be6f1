"""The prompt-state cache through real processes (issue 13).

Each worker keeps many conversations' KV states (``--cache-ram``), reports
their prefix fingerprints to the broker (CACHE_REPORT), and the broker sends
each turn to the idle worker that holds the most of its prompt. Before, a
worker's KV cache held only its last prompt: with more conversations than
workers, every follow-up turn was prefilled again from scratch.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.pool import EXACT_GREEDY, Pool, wait_until
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

#: Distinct conversations: each first turn is ~200 tokens of the tiny model
#: and starts differently, so no two share a prefix block.
OPENINGS = [
    "alpha beta gamma delta " * 12,
    "one two three four five " * 12,
    "red green blue yellow " * 12,
    "north south east west " * 12,
]
MORE = " and then the user said something else entirely"
GREEDY = {"temperature": 0.0, "max_tokens": 4}


def complete(pool: Pool, prompt: str, **fields) -> httpx.Response:
    r = httpx.post(pool.url + "/v1/completions",
                   json={"prompt": prompt, **GREEDY, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_tokens(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens"]


def slot_entries(pool: Pool) -> list[dict]:
    return httpx.get(pool.url + "/slots", timeout=10).json()


def metric(pool: Pool, name: str) -> float:
    """A series of the pool's one model (its ``model`` label: the workers'
    file's name)."""
    text = httpx.get(pool.url + "/metrics", timeout=10).text
    match = re.search(rf'^{name}{{model="tiny.gguf"}} (\S+)$', text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


#: One worker with the default --cache-ram: more conversations than slots.
one_worker = pool_fixture(workers=1, worker_args=EXACT_GREEDY)


#: One worker with --cache-ram 0: every prompt it has not just run is cold.
no_cache = pool_fixture(workers=1, worker_args=("--cache-ram", "0", *EXACT_GREEDY))


def test_interleaved_conversations_each_find_their_prefix(one_worker):
    firsts = [complete(one_worker, text) for text in OPENINGS]
    for text, first in zip(OPENINGS, firsts):
        follow_up = complete(one_worker, text + MORE)
        # All of the first turn's prompt is served from a saved state (the
        # last token of a prompt is always evaluated again).
        assert cached(follow_up) >= prompt_tokens(first) - 1, (
            text[:20], cached(follow_up), prompt_tokens(first))
    one_worker.assert_whole()


def test_restored_state_generates_what_a_cold_prefill_does(one_worker, no_cache):
    a, b = "the cat sat on the mat " * 15, "a stitch in time saves nine " * 15
    fields = {"max_tokens": 24, "ignore_eos": True}
    complete(one_worker, a, **fields)
    complete(one_worker, b, **fields)
    warm = complete(one_worker, a + MORE, **fields)
    assert cached(warm) > 100  # it really came from the restored state of `a`
    cold = complete(no_cache, a + MORE, **fields)
    assert cached(cold) <= 1
    assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]


def test_slots_and_metrics_show_the_cache(one_worker):
    for text in OPENINGS[:2]:
        complete(one_worker, text)
        complete(one_worker, text + MORE)
    (slot,) = slot_entries(one_worker)
    cache = slot["prompt_cache"]
    assert cache["states"] >= 1
    assert 0 < cache["bytes_used"] <= cache["bytes_limit"] == 2048 * 2**20
    assert cache["hits"] >= 1
    assert metric(one_worker, "llamapool_prompt_tokens_cached_total") > 0
    assert metric(one_worker, "llamapool_prompt_cache_hits_total") >= 1
    assert metric(one_worker, "llamapool_prompt_cache_bytes") == cache["bytes_used"]


def test_a_finished_conversation_is_saved_while_the_worker_is_idle(
        tiny_model, tmp_path):
    """The state is saved after the answer, not when the next prompt moves
    the worker away from it; /slots shows it without another request."""
    pool = Pool(tiny_model, tmp_path, workers=1)
    try:
        first = complete(pool, OPENINGS[0])
        wait_until(lambda: slot_entries(pool)[0]["prompt_cache"]["states"] == 1,
                   60, "the finished conversation's state in /slots")
        # The follow-up continues the live sequence; the saved state is kept
        # for the turn after another conversation.
        follow_up = complete(pool, OPENINGS[0] + MORE)
        assert cached(follow_up) >= prompt_tokens(first) - 1
        complete(pool, OPENINGS[1])
        assert cached(complete(pool, OPENINGS[0] + MORE + " ok")) > 100
        pool.assert_whole()
    finally:
        pool.stop()


def test_no_cache_worker_says_so(no_cache):
    complete(no_cache, OPENINGS[0])
    complete(no_cache, OPENINGS[1])
    (slot,) = slot_entries(no_cache)
    assert slot["prompt_cache"]["bytes_limit"] == 0
    assert slot["prompt_cache"]["states"] == 0


# --- memory stays inside the limit ---


#: --cache-ram 1 MiB: a few of the tiny model's states (~0.2 MiB each).
tiny_limit = pool_fixture(workers=1, worker_args=("--cache-ram", "1"))


def test_many_prompts_stay_inside_a_tiny_limit(tiny_limit):
    def distinct(i: int) -> str:
        return f"conversation {i} begins here " + f"word{i} " * 150

    # Past the first few jobs' one-off allocations (and a full cache).
    for i in range(20):
        complete(tiny_limit, distinct(i))
    rss_before = rss_kib(tiny_limit.workers[0].pid)
    for i in range(20, 80):
        complete(tiny_limit, distinct(i))
    grown_kib = rss_kib(tiny_limit.workers[0].pid) - rss_before
    (slot,) = slot_entries(tiny_limit)
    cache = slot["prompt_cache"]
    assert cache["bytes_limit"] == 2**20
    assert 0 < cache["bytes_used"] <= cache["bytes_limit"]
    assert cache["evictions"] >= 60
    # 60 more states of ~0.17 MiB each, kept, would be ~10 MiB.
    assert grown_kib < 4 * 1024, grown_kib
    # The newest conversations are still served from the cache.
    assert cached(complete(tiny_limit, distinct(78) + MORE)) > 100
    tiny_limit.assert_whole()


# --- routing by what each worker holds ---


prefix_pair = pool_fixture(workers=2, broker_args=("--routing", "prefix"))


lru_pair = pool_fixture(workers=2, broker_args=("--routing", "lru"))


def _three_conversations(pool: Pool) -> list[tuple[str, httpx.Response]]:
    pool.assert_whole()
    return [(text, complete(pool, text)) for text in OPENINGS[:3]]


def test_follow_ups_go_to_the_worker_that_holds_them(prefix_pair):
    # Least recently used spreads A, B, C over the two workers: A and C on
    # one, B on the other; the worker holding A ran C after it.
    for text, first in _three_conversations(prefix_pair):
        follow_up = complete(prefix_pair, text + MORE)
        assert follow_up.headers["X-Slot-Id"] == first.headers["X-Slot-Id"]
        assert cached(follow_up) >= prompt_tokens(first) - 1
    prefix_pair.assert_whole()


def test_lru_routing_ignores_what_workers_hold(lru_pair):
    (a_text, a_first), (_, b_first), _ = _three_conversations(lru_pair)
    follow_up = complete(lru_pair, a_text + MORE)
    # LRU picks B's worker, which never saw A.
    assert follow_up.headers["X-Slot-Id"] == b_first.headers["X-Slot-Id"]
    assert follow_up.headers["X-Slot-Id"] != a_first.headers["X-Slot-Id"]
    assert cached(follow_up) < prompt_tokens(a_first) // 2
    lru_pair.assert_whole()


def test_a_busy_holder_does_not_hold_up_its_conversation(prefix_pair):
    text = OPENINGS[3]
    first = complete(prefix_pair, text)
    holder = first.headers["X-Slot-Id"]
    # Keep the holder busy: a streamed follow-up nobody reads pauses for
    # credit and holds its slot.
    with httpx.stream("POST", prefix_pair.url + "/v1/completions",
                      json={"prompt": text + MORE, "max_tokens": 1500,
                            "ignore_eos": True, "stream": True},
                      timeout=60) as stuck:
        assert stuck.headers["X-Slot-Id"] == holder
        wait_until(lambda: prefix_pair.status()["slots_free"] == 1, 30,
                   "the holder to be busy")
        other = complete(prefix_pair, text + " and a different turn")
        assert other.headers["X-Slot-Id"] != holder
    prefix_pair.assert_whole(timeout_s=60)
