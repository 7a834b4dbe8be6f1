"""Retry-After says when a slot will really be free, through real processes.

It used to be the soonest busy slot's remaining tokens over its speed. A slot
paused because its client stopped reading keeps its old (fast) speed, so a
pool full of slow readers answered "Retry-After: 1" for as long as the stall
timeout let them hold their slots (a minute by default), and every client
came straight back. Heartbeats now say that a job is paused and when the
stall timeout will end it, and the broker's hint counts that down.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.pool import Pool, wait_until
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import LONG, RawStream, wait_paused

pytestmark = pytest.mark.stack

STALL_TIMEOUT_S = 30.0
TOKENS_PER_S = 200


#: One synthetic worker (a steady 200 tokens/s) that gives up on a client
#: that has not read for 30 s.
one_slot = pool_fixture(workers=1,
                        worker_args=("--engine", "synthetic", "--tokens-per-second",
                                     str(TOKENS_PER_S),
                                     "--stall-timeout-s", str(STALL_TIMEOUT_S)))


def refused_retry_after(pool: Pool) -> int:
    r = httpx.post(pool.url + "/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503, r.text
    return int(r.headers["Retry-After"])


def test_a_slot_paused_by_a_slow_reader_is_not_free_in_a_second(one_slot):
    pool = one_slot
    stream = RawStream(pool.port, LONG)  # 2000 tokens, and it stops reading
    try:
        slot_id = int(stream.header("X-Slot-Id"))
        wait_paused(pool, slot_id)
        paused_by = time.monotonic()  # the pause began before this
        hint = refused_retry_after(pool)
        stall_left_s = STALL_TIMEOUT_S - (time.monotonic() - paused_by)
        # About the stall time left: at most the whole timeout, and not far
        # below what is left (the pause began a little before we saw it).
        assert stall_left_s - 10 <= hint <= STALL_TIMEOUT_S + 1, (hint, stall_left_s)
        # The ledger shows why.
        slot = pool.status()["slots"][0]
        assert 0 < slot["progress"]["pause_ends_in_s"] <= STALL_TIMEOUT_S
    finally:
        stream.close()
    pool.assert_whole()


def test_running_jobs_keep_the_hint_small(one_slot):
    """A job read as fast as it comes, 400 tokens at 200/s: free within 2 s."""
    pool = one_slot
    done = threading.Event()

    def read_all() -> None:
        with httpx.stream("POST", pool.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 400,
                                "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
        done.set()

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        wait_until(lambda: (pool.status()["slots"][0]["progress"] or {}).get(
            "n_generated", 0) > 0, 10, "the job's first heartbeat")
        if not done.is_set():
            assert refused_retry_after(pool) <= 3
    finally:
        reader.join(timeout=30)
    pool.assert_whole()
