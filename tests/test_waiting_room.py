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


def test_a_slot_freed_as_a_new_job_arrives_goes_to_the_waiter(tmp_path):
    """The broker reads its workers before its frontends in one turn: a
    slot freed by a job's last frame, then a SUBMIT read in the same turn,
    used to give the slot to the newcomer, ahead of a job that had waited
    (a load test's TTFT p99 then counted one more job's wait)."""
    from protocol.payloads import Timings, Usage
    from workers.broker.broker import Broker
    from workers.broker.settings import BrokerSettings

    broker = Broker(BrokerSettings(frontends_endpoint=f"ipc://{tmp_path}/fe",
                                   workers_endpoint=f"ipc://{tmp_path}/wk",
                                   queue_max=8, queue_timeout_s=60))
    to_workers: list[bytes] = []
    broker.to_worker = lambda ident, frames: to_workers.append(frames) or True
    broker.to_frontend = lambda ident, msg: True
    broker._on_worker_frames(b"w", messages.Ready("w", "m", 512, 1, "h"), None)
    for job in ("running", "waited"):
        msg = submit(job, "A")
        broker._on_frontend_frames(b"fe", msg, msg.to_wire())
    assert "waited" in broker.waiting.room
    final = messages.Final("running", "length", Usage(10, 4, 14),
                           Timings(10, 1.0, 4, 1.0))
    broker._on_worker_frames(b"w", final, final.to_wire())
    late = submit("late", "A")
    broker._on_frontend_frames(b"fe", late, late.to_wire())
    assert broker.ledger.workers[b"w"].job_id == "waited"
    assert "late" in broker.waiting.room
