"""A worker of two slots (``--slots 2``), through real processes.

One worker process, one llama.cpp context with two sequences decoded as one
batch; to the broker, two slots. Each test checks what a client and the
ledger see: both slots leased on their own, a paused or cancelled slot that
leaves the other decoding (its greedy text the same as when it runs alone),
a worker death that ends both jobs with error events, a JSON schema and
log-probabilities in one slot beside a held one, embeddings beside a held
one, and prompt reuse per slot (prefix routing to the slot whose sequence
holds the prompt, a saved state restored into another slot).

Holding a slot: a client that stops reading (``tests.test_slot_paths``).
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from protocol.prefix import BLOCK_TOKENS
from tests.pool import EXACT_GREEDY, wait_until
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import LONG, RawStream, hold_slot, wait_paused

pytestmark = pytest.mark.stack

batched_pool = pool_fixture(workers=1, slots_per_worker=2, worker_args=EXACT_GREEDY)

#: A greedy completion long enough to pause for credit (what fits in the
#: socket buffers and the credit window is far less).
GREEDY = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
          "temperature": 0.0, "stream": True}


@pytest.fixture
def pool2(batched_pool):
    yield batched_pool
    batched_pool.assert_whole()


def events_of(data: bytes) -> list:
    """The SSE events of a raw HTTP response (chunk-size lines dropped)."""
    text = data.decode(errors="replace")
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def streamed_text(data: bytes) -> tuple[str, str | None]:
    """The concatenated text and the finish reason of a streamed completion."""
    text, finish = [], None
    for event in events_of(data):
        if event.strip() == "[DONE]":
            continue
        choice = json.loads(event)["choices"][0]
        text.append(choice.get("text") or "")
        finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def completion(pool, body: dict) -> dict:
    r = httpx.post(pool.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def slot_rows(pool) -> list[dict]:
    return sorted(pool.status()["slots"], key=lambda s: s["id"])


def test_one_worker_registers_two_slots(pool2):
    rows = slot_rows(pool2)
    assert len(rows) == 2
    assert len({s["id"] for s in rows}) == 2
    assert rows[0]["pid"] == rows[1]["pid"] == pool2.workers[0].pid
    assert pool2.status()["slots_free"] == 2


def test_two_streams_lease_both_slots_a_third_gets_503(pool2):
    streams = [RawStream(pool2.port, LONG) for _ in range(2)]
    try:
        assert all(s.header("X-Slot-Id") for s in streams), [s.read_until(b"\r\n\r\n")[:600] for s in streams]
        ids = {int(s.header("X-Slot-Id")) for s in streams}
        assert ids == {s["id"] for s in slot_rows(pool2)}
        for slot_id in ids:
            wait_paused(pool2, slot_id)
        assert pool2.status()["slots_free"] == 0
        r = httpx.post(pool2.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        for s in streams:
            s.close()


def test_a_paused_slot_does_not_stall_the_other(pool2):
    """One client stops reading: its slot sits the steps out, paused, while
    the other slot's job runs to its end."""
    stream, paused_id = hold_slot(pool2)
    try:
        held_at = next(s for s in slot_rows(pool2)
                       if s["id"] == paused_id)["progress"]["n_generated"]
        body = completion(pool2, {"prompt": "Hi", "max_tokens": 60,
                                  "ignore_eos": True})
        assert body["usage"]["completion_tokens"] == 60
        assert body["choices"][0]["finish_reason"] == "length"
        row = next(s for s in slot_rows(pool2) if s["id"] == paused_id)
        assert row["state"] == "busy"
        assert row["progress"]["n_generated"] == held_at
        # Reading again resumes it, to the end.
        data = stream.read_to_end()
    finally:
        stream.close()
    assert events_of(data)[-1].strip() == "[DONE]"


def test_cancel_of_one_slot_leaves_the_other_intact(pool2):
    """Slot B is cancelled (its client goes) while slot A holds a greedy job
    mid-way: B's cancel is acknowledged, and A then runs to its end with the
    very text it gives when it runs alone."""
    alone = RawStream(pool2.port, GREEDY)
    reference = streamed_text(alone.read_to_end())
    alone.close()
    assert reference[1] == "length"

    before = pool2.status()["cancel_release_s"]["count"]
    a = RawStream(pool2.port, GREEDY)
    a_id = int(a.header("X-Slot-Id"))
    b = RawStream(pool2.port, LONG)
    b_id = int(b.header("X-Slot-Id"))
    assert a_id != b_id
    try:
        wait_paused(pool2, a_id)
        wait_paused(pool2, b_id)
        b.close()
        wait_until(lambda: pool2.status()["cancel_release_s"]["count"] == before + 1,
                   15, "slot B's cancel to be acknowledged")
        assert pool2.status()["slots_free"] == 1
        assert streamed_text(a.read_to_end()) == reference
    finally:
        a.close()
        b.close()


def test_long_prompt_prefilled_in_chunks_beside_a_running_job(pool2):
    """A prompt longer than a step (n_batch 512) joins while the other slot
    holds a job; it is decoded over several steps and answered."""
    stream, _ = hold_slot(pool2)
    try:
        body = completion(pool2, {"prompt": "the cat sat on the mat " * 150,
                                  "max_tokens": 8, "ignore_eos": True})
        assert body["usage"]["prompt_tokens"] > 512
        assert body["usage"]["completion_tokens"] == 8
    finally:
        stream.close()


def test_embeddings_in_one_slot_beside_a_held_one(pool2):
    """An embedding job holds its slot and runs in the worker's embedding
    context, beside the batch."""
    held, held_id = hold_slot(pool2)
    try:
        r = httpx.post(pool2.url + "/v1/embeddings",
                       json={"input": ["Hi there", "llamas"]}, timeout=60)
        assert r.status_code == 200, r.text
        assert int(r.headers["X-Slot-Id"]) != held_id
    finally:
        held.close()
    vectors = [item["embedding"] for item in r.json()["data"]]
    assert len(vectors) == 2 and vectors[0] != vectors[1]
    for v in vectors:
        assert sum(x * x for x in v) == pytest.approx(1.0, abs=1e-3)


def test_a_schema_and_logprobs_in_one_slot_beside_a_held_one(pool2):
    """Both slots leased at once: one held by a stream that stopped reading,
    the other a JSON schema with log-probabilities (its own mask and parse
    state in the worker's one context)."""
    held, _ = hold_slot(pool2)
    try:
        r = httpx.post(pool2.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "A number?"}],
            "max_tokens": 40, "logprobs": True, "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {
                    "type": "object", "properties": {"n": {"type": "integer"}},
                    "required": ["n"], "additionalProperties": False}}}},
            timeout=60)
    finally:
        held.close()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"])["n"], int)
    entries = choice["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_worker_death_ends_both_jobs_with_error_events(pool2):
    streams = [RawStream(pool2.port, LONG) for _ in range(2)]
    try:
        for s in streams:
            wait_paused(pool2, int(s.header("X-Slot-Id")))
        victim = pool2.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.popen.wait(timeout=10)
        for s in streams:
            events = events_of(s.read_to_end())
            assert json.loads(events[-1])["error"]["code"] == "worker_died"
            assert "[DONE]" not in [e.strip() for e in events]
    finally:
        for s in streams:
            s.close()
    # No slot is left; a fresh worker brings both back.
    pool2.wait_free(0, timeout_s=15)
    pool2.workers.remove(victim)
    pool2.start_worker()
    pool2.wait_free(2, timeout_s=30)


def test_a_prompt_goes_back_to_the_slot_whose_sequence_holds_it(pool2):
    url = pool2.url + "/v1/completions"
    first = "the quick brown fox and the lazy dog " * 12
    second = "hello world this is a test you say yes " * 12
    r1 = httpx.post(url, json={"prompt": first, "max_tokens": 2}, timeout=60)
    r2 = httpx.post(url, json={"prompt": second, "max_tokens": 2}, timeout=60)
    slot1, slot2 = r1.headers["X-Slot-Id"], r2.headers["X-Slot-Id"]
    assert slot1 != slot2  # least recently used spreads the two
    before = pool2.status()["counters"].get("routed_by_prefix", 0)
    # LRU alone would now pick slot1; slot2's own sequence holds the prefix.
    r3 = httpx.post(url, json={"prompt": second + "and more", "max_tokens": 2},
                    timeout=60)
    assert r3.headers["X-Slot-Id"] == slot2
    usage = r3.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK_TOKENS
    assert pool2.status()["counters"]["routed_by_prefix"] == before + 1


def test_one_slots_saved_state_is_restored_into_the_other(pool2):
    """The worker's slots share one prompt-state cache: a conversation
    displaced from slot A's sequence is saved, and restored into slot B."""
    a, b = (row["id"] for row in slot_rows(pool2))
    url = pool2.url + "/completion"
    conversation = "a long conversation about llamas and their wool " * 12

    def native(slot: int, prompt: str) -> dict:
        r = httpx.post(url, json={"prompt": prompt, "n_predict": 2, "id_slot": slot},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    native(a, conversation)
    # Displaces it: saved before slot A's sequence is trimmed.
    native(a, "something else entirely, said over and over " * 12)
    again = native(b, conversation + "and then some more")
    assert again["id_slot"] == b
    assert again["timings"]["cache_n"] >= BLOCK_TOKENS
