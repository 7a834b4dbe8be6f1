"""Unit and property tests for the multi-broker bookkeeping.

``BrokerPool`` (the frontend's links to several brokers) with in-process
stand-in links, ``merge_statuses`` (the pool-wide ledger) and
``BrokerChoice`` (which broker a worker registers with). The same rules go
through real processes in ``tests/faults/test_two_brokers.py``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.broker_link import JobStream
from frontend.broker_pool import BrokerPool, ConversationRoutes
from frontend.pool_view import SLOT_ID_STRIDE, merge_statuses
from protocol import messages
from protocol.broker_list import split_endpoints
from protocol.errors import ErrorCode
from protocol.payloads import (
    GenerationRequest,
    HistogramSnapshot,
    PoolStatus,
    PoolTotals,
    SlotStatus,
)
from protocol.settings import ConfigError
from workers.model.broker_choice import BrokerChoice


class FakeLink:
    """A broker link whose answers the test scripts."""

    heartbeat_interval_s = 1.0

    def __init__(self, answers: list[str] | None = None) -> None:
        self.answers = list(answers or [])
        self.streams: dict[str, JobStream] = {}
        self.submitted: list[str] = []
        self.id_slots: list[int] = []
        self.sent: list[messages.Message] = []
        self.forgotten: list[str] = []
        self.last_heard = time.monotonic()
        self.status_reply: PoolStatus | None = None

    def start(self):
        return self

    def broker_alive(self) -> bool:
        return True

    def submit(self, job_id, request, blocks=None, id_slot=-1,
               origin=None) -> JobStream:
        self.submitted.append(job_id)
        self.id_slots.append(id_slot)
        stream = self.streams[job_id] = JobStream(job_id)
        answer = self.answers.pop(0) if self.answers else "accept"
        if answer == "accept":
            stream.accepted = True
            stream.put(messages.Accepted(job_id, 3, "m"))
        elif answer == "full":
            stream.put(messages.NoSlot(job_id, 2.0 + len(self.submitted)))
        elif answer == "lost":
            stream.put(messages.Error(job_id, ErrorCode.BROKER_UNREACHABLE, "lost"))
        elif answer == "engine":
            stream.put(messages.Error(job_id, ErrorCode.ENGINE_ERROR, "bad"))
        return stream

    def send(self, msg) -> None:
        self.sent.append(msg)

    def forget(self, job_id) -> None:
        self.forgotten.append(job_id)
        self.streams.pop(job_id, None)

    def status(self, timeout_s, max_age_s=0.0):
        return self.status_reply


REQUEST = GenerationRequest(kind="completion", prompt="hi")


def test_refusal_moves_on_and_the_slot_id_names_the_broker():
    links = [FakeLink(["full"]), FakeLink(["accept"])]
    pool = BrokerPool(links)
    stream = pool.submit("j1", REQUEST)
    # Whichever broker came first, the job ends accepted by broker 1.
    answer = stream.get(1.0)
    assert isinstance(answer, messages.Accepted)
    assert answer.slot_id == SLOT_ID_STRIDE + 3
    pool.send(messages.Cancel("j1"))
    assert [type(m) for m in links[1].sent] == [messages.Cancel]
    assert links[0].sent == []


def test_id_slot_goes_to_its_broker_alone_with_its_own_id():
    """llama.cpp's id_slot names a slot in /slots: broker 1's slot 3 is shown
    as SLOT_ID_STRIDE + 3, and only broker 1 is asked, for its slot 3; a full
    slot is not moved to another broker (BrokerPool.submit had no id_slot:
    every such request was a 500 through several brokers)."""
    links = [FakeLink(["accept"]), FakeLink(["full"])]
    pool = BrokerPool(links)
    answer = pool.submit("j", REQUEST, id_slot=SLOT_ID_STRIDE + 3).get(1.0)
    assert isinstance(answer, messages.NoSlot)
    assert links[0].submitted == [] and links[1].id_slots == [3]
    # An id beyond the brokers: the first broker's ledger refuses it.
    pool.submit("k", REQUEST, id_slot=5 * SLOT_ID_STRIDE).get(1.0)
    assert links[0].id_slots == [5 * SLOT_ID_STRIDE]


def test_every_broker_full_answers_no_slot_with_the_soonest_hint():
    links = [FakeLink(["full"]), FakeLink(["full"]), FakeLink(["full"])]
    pool = BrokerPool(links)
    answer = pool.submit("j", REQUEST).get(1.0)
    assert isinstance(answer, messages.NoSlot)
    assert answer.retry_after_s == 3.0  # 2 + first submit on its link
    assert sorted(len(link.submitted) for link in links) == [1, 1, 1]


def test_a_worker_error_is_not_retried_elsewhere():
    links = [FakeLink(["engine"]), FakeLink(["engine"])]
    pool = BrokerPool(links)
    answer = pool.submit("j", REQUEST).get(1.0)
    assert isinstance(answer, messages.Error) and answer.code == ErrorCode.ENGINE_ERROR
    assert sum(len(link.submitted) for link in links) == 1


def test_a_silent_broker_is_tried_last():
    links = [FakeLink(), FakeLink()]
    links[0].last_heard = time.monotonic() - 10  # heartbeat long overdue
    pool = BrokerPool(links)
    for _ in range(4):
        assert pool.order_for([])[0] == 1


def test_a_follow_up_turn_goes_to_the_broker_of_the_previous_turn():
    links = [FakeLink(), FakeLink(), FakeLink()]
    pool = BrokerPool(links)
    first = pool.submit("t1", REQUEST, [11, 12])
    first.get(1.0)
    served_by = first.broker_index
    for i in range(5):
        follow_up = pool.submit(f"t2-{i}", REQUEST, [11, 12, 13])
        assert follow_up.broker_index == served_by


def test_conversation_routes_are_bounded():
    routes = ConversationRoutes(capacity=10)
    for i in range(100):
        routes.remember([i], i % 3)
    assert len(routes) == 10
    assert routes.broker_for([99]) == 0 and routes.broker_for([0]) is None


_ANSWERS = st.sampled_from(["accept", "full", "lost", "engine"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_ANSWERS, min_size=4, max_size=4), min_size=2, max_size=4),
       st.integers(1, 8))
def test_each_job_is_held_by_one_broker_and_each_broker_asked_once(scripts, n_jobs):
    """Whatever the brokers answer, a job is submitted to each broker at most
    once, ends held by at most one, and its release leaves nothing behind."""
    links = [FakeLink(script) for script in scripts]
    pool = BrokerPool(links)
    for j in range(n_jobs):
        job_id = f"job{j}"
        stream = pool.submit(job_id, REQUEST)
        answer = stream.get(1.0)
        asked = [i for i, link in enumerate(links) if job_id in link.submitted]
        assert all(link.submitted.count(job_id) <= 1 for link in links)
        holding = [i for i, link in enumerate(links) if job_id in link.streams]
        # The old brokers' routes were dropped on moving on.
        assert holding == [stream.broker_index]
        if isinstance(answer, messages.Accepted):
            assert answer.slot_id // SLOT_ID_STRIDE == stream.broker_index
        elif isinstance(answer, messages.NoSlot):
            assert len(asked) == len(links)
        # The lease's release: CANCEL to the holder only, then forget.
        pool.send(messages.Cancel(job_id))
        pool.forget(job_id)
        cancels = [i for i, link in enumerate(links)
                   if any(getattr(m, "job_id", None) == job_id for m in link.sent)]
        assert cancels == [stream.broker_index]
    assert pool._job_broker == {}
    assert all(link.streams == {} for link in links)


def _slot(slot_id, name, state="idle") -> SlotStatus:
    return SlotStatus(id=slot_id, state=state, id_task=None, worker_name=name,
                      host="h", pid=len(name), model="m", engine="synthetic",
                      n_ctx=64, lease_age_s=None, lease_taken_at=None,
                      jobs_served=0)


def _status(slots: list[SlotStatus], frontends=2) -> PoolStatus:
    hist = HistogramSnapshot(buckets=[1.0], cumulative=[1, 1], sum=0.5, count=1,
                             p50=0.5, max=0.5, recent=[0.5])
    totals = PoolTotals(1, 2, 3, 0, 0, 0.1, 0.2, hist)
    free = sum(1 for s in slots if s.state == "idle")
    busy = sum(1 for s in slots if s.state == "busy")
    return PoolStatus(slots=slots, slots_total=len(slots), slots_loading=0,
                      slots_busy=busy, slots_free=free, kv_cache_usage_level=0.5,
                      jobs=busy, frontends=frontends, counters={"no_slot": 1},
                      stats=totals, retry_after_s=1.0 if free else 4.0)


def test_merged_ledger_counts_each_worker_once():
    a = _status([_slot(0, "w0"), _slot(1, "moved")])
    b = _status([_slot(0, "w1", "busy"), _slot(1, "moved")])
    merged = merge_statuses([(0, a), (1, b)])
    assert [s.id for s in merged.slots] == [0, 1, SLOT_ID_STRIDE]
    assert merged.slots_total == 3 and merged.slots_free == 2
    assert merged.slots_busy == 1
    assert merged.stats.request_success_total == 6
    assert merged.cancel_release_s.count == 2
    assert merged.counters == {"no_slot": 2}
    assert merged.frontends == 2


def test_merged_totals_that_are_not_sums():
    """The longest sequence is a maximum; the counters' start is the newest
    broker start (an older one would hide the reset from a scraper)."""
    a, b = _status([_slot(0, "w0")]), _status([_slot(0, "w1")])
    a = dataclasses.replace(a, stats=dataclasses.replace(
        a.stats, n_tokens_max=300, started_at_unix=1000.0, n_decode_total=5))
    b = dataclasses.replace(b, stats=dataclasses.replace(
        b.stats, n_tokens_max=200, started_at_unix=2000.0, n_decode_total=7))
    merged = merge_statuses([(0, a), (1, b)]).stats
    assert merged.n_tokens_max == 300
    assert merged.started_at_unix == 2000.0
    assert merged.n_decode_total == 12


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.booleans()),
                         max_size=6), min_size=1, max_size=3))
def test_merged_ledger_property(ledgers):
    """Any ledgers, with workers seen in several: one entry per worker, ids
    unique, free never above the idle workers shown."""
    replies = []
    for index, workers in enumerate(ledgers):
        unique = dict(workers)  # one entry per worker within a ledger
        slots = [_slot(n, f"w{w}", "busy" if busy else "idle")
                 for n, (w, busy) in enumerate(unique.items())]
        replies.append((index, _status(slots)))
    merged = merge_statuses(replies)
    names = [s.worker_name for s in merged.slots]
    assert len(names) == len(set(names))
    assert len({s.id for s in merged.slots}) == len(merged.slots)
    idle = sum(1 for s in merged.slots if s.state == "idle")
    assert merged.slots_free == idle  # no phantom (or double-counted) free slot
    assert merged.slots_total == len(merged.slots)


def test_broker_lists_parse_and_reject():
    assert split_endpoints("tcp://a:1, tcp://b:2") == ("tcp://a:1", "tcp://b:2")
    with pytest.raises(ConfigError):
        split_endpoints(" , ")
    with pytest.raises(ConfigError):
        split_endpoints("tcp://a:1,tcp://a:1")


@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4, unique=True),
       st.text(max_size=20), st.integers(0, 12))
def test_a_worker_moves_through_every_broker_in_turn(endpoints, name, losses):
    choice = BrokerChoice(tuple(endpoints), name)
    first = choice.current
    seen = [first]
    for _ in range(losses):
        seen.append(choice.broker_lost())
    n = len(endpoints)
    if n == 1:
        assert set(seen) == {first} and choice.moves == 0
    else:
        # Never the same broker twice in a row; every one within n moves.
        assert all(x != y for x, y in zip(seen, seen[1:]))
        if losses >= n - 1:
            assert set(seen[:n]) == set(endpoints)


def test_workers_spread_over_the_brokers():
    endpoints = ("a", "b")
    starts = [BrokerChoice(endpoints, f"host:{pid}").current for pid in range(100)]
    assert 30 < starts.count("a") < 70


def test_status_merges_the_live_brokers_and_skips_a_lost_one():
    links = [FakeLink(), FakeLink(), FakeLink()]
    links[0].status_reply = _status([_slot(0, "w0")])
    links[1].status_reply = _status([_slot(0, "w1", "busy")])
    links[2].status_reply = _status([_slot(0, "w2")])
    links[2].broker_alive = lambda: False  # heard before, silent since
    merged = BrokerPool(links).status(1.0)
    assert sorted(s.worker_name for s in merged.slots) == ["w0", "w1"]
    assert (merged.slots_total, merged.slots_free) == (2, 1)
