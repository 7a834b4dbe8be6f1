"""Who gets a freed slot (``workers.broker.waiting_room.WaitingRoom.pick``),
in process: least recent service by key, or first come, first served."""

from __future__ import annotations

import pytest

from protocol import messages
from protocol.payloads import COMPLETION, GenerationRequest
from workers.broker.waiting_room import WaitingRoom


def submit(job_id: str, client: str, prompt: int = 10) -> messages.Submit:
    return messages.Submit(job_id, GenerationRequest(
        kind=COMPLETION, prompt_tokens=list(range(prompt))), client=client)


@pytest.mark.parametrize("fair, order", [
    (True, ["b1", "a1", "a2", "a3"]),   # B, served least, first
    (False, ["a1", "a2", "a3", "b1"]),  # arrival order
])
def test_a_freed_slot_goes_by_the_rooms_order(fair, order):
    room = WaitingRoom(max_jobs=8, max_tokens=0, timeout_s=60, fair=fair)
    room.on_start(submit("a0", "A", prompt=100), 0.0)  # A was served lately
    for i, job in enumerate(["a1", "a2", "a3", "b1"]):
        room.admit(b"frontend", submit(job, job[0].upper()), [], [], 1.0 + i)
    picked = []
    for _ in range(4):
        waiter = room.pick(lambda w: 0, 10.0)
        picked.append(waiter.job_id)
        room.on_start(waiter.submit, 10.0)
    assert picked == order
