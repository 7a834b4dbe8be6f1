"""``Ledger.assign_slot``: llama.cpp's ``id_slot`` leases exactly that slot."""

from __future__ import annotations

import pytest

from protocol import messages
from workers.broker.ledger import BUSY, IDLE, Ledger


def _ledger_with(n: int) -> tuple[Ledger, list[int]]:
    ledger = Ledger(3.0)
    ids = []
    for i in range(n):
        slot, _ = ledger.register_worker(
            f"w{i}".encode(), messages.Ready(f"w{i}", "m", 512, 1, "h"), 0.0)
        ids.append(slot.slot_id)
    return ledger, ids


def test_the_named_slot_is_leased_even_when_another_would_be_chosen():
    ledger, ids = _ledger_with(3)
    # assign() would pick the least recently used: the first registered.
    slot = ledger.assign_slot(ids[2], "j1", b"f", 1.0)
    assert slot is not None and slot.slot_id == ids[2]
    assert slot.state == BUSY and slot.job_id == "j1"
    assert ledger.jobs["j1"].worker == slot.identity
    assert ledger.free_slots() == 2


def test_a_busy_slot_is_refused_and_nothing_else_is_taken():
    ledger, ids = _ledger_with(2)
    assert ledger.assign_slot(ids[0], "j1", b"f", 1.0) is not None
    assert ledger.assign_slot(ids[0], "j2", b"f", 1.0) is None
    assert "j2" not in ledger.jobs
    assert ledger.free_slots() == 1


def test_an_unknown_slot_raises_and_takes_nothing():
    ledger, ids = _ledger_with(2)
    with pytest.raises(KeyError):
        ledger.assign_slot(max(ids) + 7, "j1", b"f", 1.0)
    assert ledger.jobs == {} and ledger.free_slots() == 2


def test_the_slot_is_free_again_after_its_job_ends():
    ledger, ids = _ledger_with(1)
    ledger.assign_slot(ids[0], "j1", b"f", 1.0)
    ledger.finish("j1", 2.0)
    slot = next(iter(ledger.workers.values()))
    assert slot.state == IDLE and slot.jobs_served == 1
    assert ledger.assign_slot(ids[0], "j2", b"f", 3.0) is not None


def test_a_draining_slot_is_not_leased():
    ledger, ids = _ledger_with(1)
    next(iter(ledger.workers.values())).draining = True
    assert ledger.assign_slot(ids[0], "j1", b"f", 1.0) is None
