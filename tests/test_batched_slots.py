"""A worker of two slots (``--slots 2``), through real processes.

One worker process, one llama.cpp context with two sequences decoded as one
batch; to the broker, two slots. Each test checks what a client and the
ledger see: both slots leased on their own, a paused or cancelled slot that
leaves the other decoding (its greedy text the same as when it runs alone),
a worker death that ends both jobs with error events, and the features the
batched engine refuses by name.

Holding a slot: a client that stops reading (``tests.test_slot_paths``).
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.pool import wait_until
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import LONG, RawStream, hold_slot, wait_paused

pytestmark = pytest.mark.stack

batched_pool = pool_fixture(workers=1, slots_per_worker=2)

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


@pytest.mark.parametrize("field, value, named", [
    ("logprobs", 2, "logprobs"),
    ("grammar", 'root ::= "a"', "grammar"),
    ("logit_bias", {"1": 2.0}, "logit_bias"),
])
def test_features_the_batched_engine_lacks_are_refused_by_name(pool2, field,
                                                               value, named):
    r = httpx.post(pool2.url + "/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert f"the batched llama.cpp engine has no {named}" in r.text


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
