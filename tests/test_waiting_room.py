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


#: The prefix blocks of a prompt a worker holds (its fingerprints stand in).
WARM, COLD = [11, 12, 13], [21, 22, 23]


def held_by_the_idle_worker(waiter) -> int:
    """The freed slot's worker holds WARM's three blocks and nothing else."""
    return 3 if waiter.blocks == WARM else 0


@pytest.mark.parametrize("fair, first", [(True, "a-warm"), (False, "a-cold")])
def test_among_one_keys_jobs_the_one_whose_prompt_the_worker_holds_goes_first(
        fair, first):
    """Late binding to the cache: the slot is matched to a job when it frees,
    and of the jobs the fairness rule allows, the one whose prompt that
    worker holds best goes, ahead of an older one (FIFO keeps arrival order)."""
    room = WaitingRoom(max_jobs=8, max_tokens=0, timeout_s=60, fair=fair)
    room.admit(b"frontend", submit("a-cold", "A"), [], COLD, 1.0)
    room.admit(b"frontend", submit("a-warm", "A"), [], WARM, 2.0)
    assert room.pick(held_by_the_idle_worker, 10.0).job_id == first


def test_the_cache_does_not_override_fairness_between_keys():
    """A key served less goes first even with a prompt the worker does not
    hold: the cache only orders the jobs of the key whose turn it is."""
    room = WaitingRoom(max_jobs=8, max_tokens=0, timeout_s=60, fair=True)
    room.on_start(submit("a0", "A", prompt=100), 0.0)  # A was served lately
    room.admit(b"frontend", submit("a-warm", "A"), [], WARM, 1.0)
    room.admit(b"frontend", submit("b-cold", "B"), [], COLD, 2.0)
    assert room.pick(held_by_the_idle_worker, 10.0).job_id == "b-cold"
    assert room.pick(held_by_the_idle_worker, 10.0).job_id == "a-warm"


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


def test_the_queue_ahead_adds_one_lease_per_slot_full_of_waiters():
    """What a Retry-After adds for the queue (``queue_wait_s``): the jobs
    waiting ahead, over the live slots, times how long a lease has lasted
    lately; per model when the request names one."""
    room = WaitingRoom(max_jobs=8, max_tokens=0, timeout_s=60, fair=True)
    assert room.queue_wait_s(live_slots=2) == 0.0
    # Leases learnt from jobs that ran: every one lasted 10 s.
    for i in range(60):
        room.on_start(submit(f"ran{i}", "A"), 100.0 * i)
        room.on_end(f"ran{i}", None, 100.0 * i + 10.0)
    for i in range(4):
        room.admit(b"frontend", submit(f"w{i}", "A"), [], [], 1.0)
    assert room.queue_wait_s(live_slots=2) == pytest.approx(20.0, rel=0.01)
    assert room.queue_wait_s(live_slots=4) == pytest.approx(10.0, rel=0.01)
    assert room.queue_wait_s(live_slots=0) == 0.0
    other = messages.Submit("other", GenerationRequest(
        kind=COMPLETION, prompt_tokens=[1], model="other-model"), client="A")
    room.admit(b"frontend", other, [], [], 2.0)
    assert room.queue_wait_s(live_slots=1, model="other-model") == pytest.approx(
        10.0, rel=0.01)
