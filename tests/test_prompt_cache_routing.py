"""The broker's side of the prompt-state cache, without processes: what a
CACHE_REPORT may carry, and how the ledger routes by it (the system tests in
``tests/test_prompt_cache.py`` run the same through real processes)."""

from __future__ import annotations

import msgpack
import pytest

from protocol import limits, messages
from protocol.prefix import MAX_BLOCKS, prefix_blocks
from protocol.prompt_cache import PromptCacheStatus
from protocol.records import MalformedMessage
from workers.broker.ledger import MAX_HELD_FINGERPRINTS, Ledger
from workers.broker.pool_stats import PoolStats


def ready(name: str) -> messages.Ready:
    return messages.Ready(name, "m", 512, 1, "h")


def conversation(seed: int, n_tokens: int = 320) -> list[int]:
    return [seed * 1000 + i for i in range(n_tokens)]


def report(*token_lists: list[int]) -> messages.CacheReport:
    return messages.CacheReport([prefix_blocks(t) for t in token_lists],
                                PromptCacheStatus(states=len(token_lists)))


def two_workers(prefer_prefix: bool = True) -> Ledger:
    ledger = Ledger(3.0, prefer_prefix=prefer_prefix)
    ledger.register_worker(b"w1", ready("w1"), 0.0)
    ledger.register_worker(b"w2", ready("w2"), 0.1)
    return ledger


def test_a_full_report_round_trips():
    states = [[i * 7 + j for j in range(MAX_BLOCKS)]
              for i in range(limits.MAX_REPORTED_STATES)]
    msg = messages.CacheReport(states, PromptCacheStatus(3, 10, 20, 1, 2, 3, 4))
    assert messages.decode(msg.to_wire()) == msg


@pytest.mark.parametrize("states", [
    [[1]] * (limits.MAX_REPORTED_STATES + 1),  # too many states
    [list(range(MAX_BLOCKS + 1))],  # too many blocks in one
    [["x"]],  # not fingerprints
])
def test_an_oversized_or_mistyped_report_is_malformed(states):
    frames = [messages.PROTOCOL_HEADER, messages.CacheReport.COMMAND,
              msgpack.packb([states, [0, 0, 0, 0, 0, 0, 0]])]
    with pytest.raises(MalformedMessage):
        messages.decode(frames)


def test_any_cached_state_attracts_its_conversation():
    ledger = two_workers()
    a, b, c = conversation(1), conversation(2), conversation(3)
    w1, w2 = ledger.workers[b"w1"], ledger.workers[b"w2"]
    # w1's live sequence is c, but it still holds a in its cache.
    ledger.record_cache_report(w1, report(c, a))
    ledger.record_cache_report(w2, report(b))
    slot = ledger.assign("j1", b"f", 1.0, prefix_blocks(a + [5, 6, 7]))
    assert slot.identity == b"w1"
    assert slot.shared_blocks_at_assign == len(prefix_blocks(a))


def test_among_equal_holders_the_one_holding_it_live_wins():
    """Two slots of one batched worker report the worker's one cache: the
    slot whose own sequence holds the prompt needs no restore, even when
    the other was idle longer."""
    ledger = two_workers()
    a, b = conversation(1), conversation(2)
    ledger.record_cache_report(ledger.workers[b"w1"], report(b, a))  # saved
    ledger.record_cache_report(ledger.workers[b"w2"], report(a, b))  # live
    slot = ledger.assign("j1", b"f", 1.0, prefix_blocks(a + [5, 6, 7]))
    assert slot.identity == b"w2"


def test_the_longest_held_prefix_wins_and_ties_go_to_the_least_recently_used():
    ledger = two_workers()
    a = conversation(1, 640)
    ledger.record_cache_report(ledger.workers[b"w1"], report(a[:320]))
    ledger.record_cache_report(ledger.workers[b"w2"], report(a[:480]))
    assert ledger.assign("j1", b"f", 1.0, prefix_blocks(a)).identity == b"w2"
    ledger.finish("j1", 2.0)
    # Nobody holds this one: least recently used (w1, idle since 0.0).
    assert ledger.assign("j2", b"f", 3.0,
                         prefix_blocks(conversation(9))).identity == b"w1"


def test_lru_routing_ignores_what_workers_hold():
    ledger = two_workers(prefer_prefix=False)
    a = conversation(1)
    ledger.record_cache_report(ledger.workers[b"w2"], report(a))
    assert ledger.assign("j1", b"f", 1.0, prefix_blocks(a)).identity == b"w1"


def test_a_busy_holder_is_not_waited_for():
    ledger = two_workers()
    a = conversation(1)
    ledger.record_cache_report(ledger.workers[b"w1"], report(a))
    assert ledger.assign("j1", b"f", 1.0, prefix_blocks(a)).identity == b"w1"
    assert ledger.assign("j2", b"f", 1.1, prefix_blocks(a)).identity == b"w2"
    assert ledger.assign("j3", b"f", 1.2, prefix_blocks(a)) is None  # NO_SLOT


def test_what_a_worker_holds_stays_bounded_without_reports():
    ledger = Ledger(3.0)
    ledger.register_worker(b"w1", ready("w1"), 0.0)
    slot = ledger.workers[b"w1"]
    ledger.record_cache_report(slot, report(conversation(0)))
    for i in range(1, 400):  # jobs whose reports never arrive
        ledger.assign(f"j{i}", b"f", float(i), prefix_blocks(conversation(i, 4096)))
        ledger.finish(f"j{i}", float(i) + 0.5)
        assert len(slot.cached_blocks) <= MAX_HELD_FINGERPRINTS


def test_slots_show_the_reported_figures():
    ledger = two_workers()
    status = PromptCacheStatus(states=2, bytes_used=5, bytes_limit=9, hits=1)
    ledger.record_cache_report(ledger.workers[b"w1"],
                               messages.CacheReport([], status))
    snap = ledger.snapshot(0.0, {}, PoolStats().totals())
    assert [s.prompt_cache for s in snap.slots] == [status, None]
