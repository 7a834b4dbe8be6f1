"""A stream whose client is behind gets the frames waiting for it as one
event (``frontend.frame_merge``, ``--merge-waiting-frames``), through real
processes: gunicorn, the broker and a worker on the test model.

The client stops reading until its worker pauses for credit, so a backlog
of frames waits at the frontend; then it reads to the end. llama.cpp's
native ``/completion`` stream names each chunk's token ids, which shows how
many tokens each event carries, and that none was lost, doubled or moved.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.pool_factory import pool_fixture
from tests.test_slot_paths import RawStream, wait_paused

pytestmark = pytest.mark.stack

MERGE_FRAMES_MAX = 64
merging_pool = pool_fixture(workers=1, frontend_env={
    "LLAMAPOOL_MERGE_WAITING_FRAMES": str(MERGE_FRAMES_MAX)})

#: Long enough that the worker pauses for credit before it is done: with
#: ``n_probs`` a token costs some 180 bytes even merged, so the frontend's
#: send buffer and the client's small window hold under a thousand, the
#: credit window 256 frames more (the context is 2048).
N_PREDICT = 1900
PROMPT = "Once upon a time"


def data_events(raw: bytes) -> list[dict]:
    """The JSON events of a raw chunked SSE response (each event is one
    chunk, so no ``data:`` line is split)."""
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
            if line.startswith(b"data: ")]


def test_a_client_that_falls_behind_gets_its_backlog_in_fewer_events(merging_pool):
    body = {"prompt": PROMPT, "n_predict": N_PREDICT, "ignore_eos": True,
            "temperature": 0, "cache_prompt": False, "n_probs": 2, "stream": True}
    stream = RawStream(merging_pool.port, body, path="/completion")
    try:
        slot = int(stream.header("X-Slot-Id"))
        wait_paused(merging_pool, slot)
        *chunks, final = data_events(stream.read_to_end())
    finally:
        stream.close()
    merging_pool.assert_whole()
    per_chunk = [len(c["tokens"]) for c in chunks]
    assert max(per_chunk) > 1, "the backlog went out one frame per event"
    assert max(per_chunk) <= MERGE_FRAMES_MAX
    for chunk, n in zip(chunks, per_chunk):
        assert len(chunk["completion_probabilities"]) == n
    assert final["stop"] and final["tokens_predicted"] == N_PREDICT
    streamed_ids = [t for c in [*chunks, final] for t in c["tokens"]]
    assert len(streamed_ids) == N_PREDICT

    # The same job, not streamed, on the same slot: the same tokens and text.
    whole = httpx.post(f"{merging_pool.url}/completion", timeout=120, json={
        **body, "stream": False, "n_probs": 0, "return_tokens": True,
        "id_slot": slot}).json()
    assert streamed_ids == whole["tokens"]
    assert "".join(c["content"] for c in [*chunks, final]) == whole["content"]
