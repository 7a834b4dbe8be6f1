"""How a job ends when something fails mid-stream, through real processes.

Two failures the client cannot cause by hanging up, each on a pool of
synthetic workers (``tok0 tok1 ...`` at a fixed rate), checked in the
broker's ledger and counters, asked over its real socket:

* the frontend gives up on a silent worker (its frame timeout): that is a
  failure on the frontend's side, so it must CANCEL, and the slot must come
  back through the worker's acknowledgement, long before the worker would
  have finished by itself;
* the worker gives up on a client that stopped reading (``client_stalled``):
  the error event says what its HTTP answer would have said, a 408 of type
  ``invalid_request_error``, not a generic server error.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.pool import sse_events
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import RawStream
from workers.model.synthetic_engine import token_text

pytestmark = pytest.mark.stack

#: The stalling worker: one token per 0.1 s.
SLOW_TPS = 10
#: Tokens 1..HELD_TOKENS spell the start of a stop string that never
#: completes, so the worker holds them back: after ``tok0`` the stream is
#: silent for HELD_TOKENS / SLOW_TPS seconds (6 s) while the worker computes.
HELD_TOKENS = 60
HOLD_STOP = "".join(token_text(i) for i in range(1, HELD_TOKENS + 1)) + " never"
FRAME_TIMEOUT_S = 2
#: Left alone, the job runs MAX_TOKENS / SLOW_TPS = 25 s.
MAX_TOKENS = 250


#: One slow synthetic worker behind a frontend with a short frame timeout.
slow_pool = pool_fixture(
    workers=1,
    worker_args=("--engine", "synthetic", "--tokens-per-second", str(SLOW_TPS)),
    frontend_env={"LLAMAPOOL_FRAME_TIMEOUT_S": str(FRAME_TIMEOUT_S)})


#: One fast synthetic worker that gives up on a silent client after 1 s.
stalling_pool = pool_fixture(
    workers=1, worker_args=("--engine", "synthetic", "--tokens-per-second", "1000",
                            "--stall-timeout-s", "1"))


def test_frame_timeout_mid_stream_cancels_the_job(slow_pool):
    pool = slow_pool
    before = pool.status()
    body = {"prompt": "Hi", "max_tokens": MAX_TOKENS, "stream": True,
            "stop": [HOLD_STOP]}
    with httpx.stream("POST", pool.url + "/v1/completions", json=body,
                      timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    # One token, then the frontend's timeout ends the stream for the client.
    assert events[0]["choices"][0]["text"] == "tok0"
    assert events[-1]["error"]["code"] == "timeout"
    assert events[-1]["error"]["status"] == 504
    assert "[DONE]" not in events
    # The worker, left alone, would hold the slot for about 20 s more. An
    # acknowledged cancel frees it at the next token.
    snap = pool.wait_free(1, timeout_s=12)
    assert (snap["cancel_release_s"]["count"]
            == before["cancel_release_s"]["count"] + 1)
    stats, was = snap["stats"], before["stats"]
    assert stats["request_cancelled_total"] == was["request_cancelled_total"] + 1
    assert stats["request_success_total"] == was["request_success_total"]
    assert (stats["tokens_generated_total"] - was["tokens_generated_total"]
            < MAX_TOKENS / 2)


def test_stalled_client_gets_a_408_invalid_request_error_event(stalling_pool):
    pool = stalling_pool
    before = pool.status()["stats"]["request_fail_total"]
    stream = RawStream(pool.port, {"prompt": "Hi", "max_tokens": 2000,
                                   "stream": True})
    try:
        assert stream.header("X-Slot-Id") is not None
        # The client reads nothing more: buffers fill, credit stops, and the
        # worker ends the job with an error, which frees the slot.
        snap = pool.wait_free(1, timeout_s=20)
        assert snap["stats"]["request_fail_total"] == before + 1
        data = stream.read_to_end().decode()
    finally:
        stream.close()
    events = [line[6:] for line in data.split("\n") if line.startswith("data: ")]
    error = json.loads(events[-1])["error"]
    assert error["code"] == "client_stalled"
    assert (error["type"], error["status"]) == ("invalid_request_error", 408)
    assert "[DONE]" not in events
