"""``PromptStateCache``'s lookups on their own (no model): they run in a
job's time to first token, so they must not grow with the number of states
when the newest one serves."""

from __future__ import annotations

from workers.model import prompt_cache
from workers.model.prompt_cache import MIB, PromptStateCache

PROMPT = list(range(100))


def counting_comparisons(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = prompt_cache.common_prefix

    def counted(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(prompt_cache, "common_prefix", counted)
    return calls


def one_prompt_many_replies() -> PromptStateCache:
    """One prompt answered fifty times with different sampled replies (a
    benchmark, "regenerate"): fifty states, none a prefix of another."""
    cache = PromptStateCache(64 * MIB, "model")
    for reply in range(50):
        assert cache.put(PROMPT + [1000 + reply, 7], b"kv" * 500)
    assert len(cache) == 50
    return cache


def test_a_lookup_stops_at_the_newest_state_that_holds_the_whole_prompt(monkeypatch):
    cache = one_prompt_many_replies()
    calls = counting_comparisons(monkeypatch)
    key, shared = cache.longest_prefix(PROMPT)
    assert shared == len(PROMPT)
    assert len(calls) == 1  # was one per state: 50
    assert cache._states[key].tokens[len(PROMPT)] == 1049  # the newest


def test_holds_finds_the_state_saved_last_first(monkeypatch):
    cache = one_prompt_many_replies()
    calls = counting_comparisons(monkeypatch)
    assert cache.holds(PROMPT + [1049, 7])
    assert len(calls) == 1  # was one per state: 50
    assert not cache.holds(PROMPT + [1049, 8])


def test_the_longest_shared_prefix_still_wins():
    cache = PromptStateCache(64 * MIB, "model")
    cache.put(PROMPT[:10] + [900], b"a")
    cache.put(PROMPT[:60] + [901], b"b")
    cache.put(PROMPT[:30] + [902], b"c")
    key, shared = cache.longest_prefix(PROMPT)
    assert shared == 60
    assert cache._states[key].data == b"b"
