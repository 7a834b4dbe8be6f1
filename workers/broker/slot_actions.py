"""llama-server's slot actions at the broker: the slot is leased for them.

A SLOT_ACTION (save, restore or erase one slot's KV sequence) names its slot
by ``id_slot`` as a SUBMIT with ``id_slot`` does, and is leased the same
way (``Ledger.assign_slot``), so it never runs while that slot generates and
no job gets the slot while it runs. llama-server defers such a task until
the slot is idle; here a busy (or loading, or draining) slot answers
NO_SLOT at once, with the pool's Retry-After, as ``id_slot`` does without a
queue: the action waits in no queue, so it cannot sit behind a long
generation holding a frontend thread. An unknown slot is ERROR
``invalid_slot`` ("Invalid slot ID"), as for a job.

The worker answers with exactly one SLOT_DONE, the action's terminal frame:
it is passed on to the frontend and frees the slot, and counts no job in the
pool's request totals (no request ran). A worker that dies during the action
fails it as it fails a job (ERROR ``worker_died``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import messages, timing
from protocol.errors import ErrorCode

if TYPE_CHECKING:
    from workers.broker.broker import Broker


class SlotActions:
    """``Broker``'s SLOT_ACTION and SLOT_DONE handlers."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def on_action(self, ident: bytes, msg: messages.SlotAction, raw: list[bytes],
                  now: float) -> None:
        """A frontend asks: lease the slot and hand the action to its worker."""
        b = self._broker
        if msg.job_id in b.ledger.jobs or msg.job_id in b.waiting.room:
            b.to_frontend(ident, messages.Error(
                msg.job_id, ErrorCode.DUPLICATE_JOB, "duplicate job id"))
            return
        try:
            slot = b.ledger.assign_slot(msg.id_slot, msg.job_id, ident, now)
        except KeyError:
            b.to_frontend(ident, messages.Error(
                msg.job_id, ErrorCode.INVALID_SLOT, "Invalid slot ID"))
            return
        if slot is None:
            b.to_frontend(ident, messages.NoSlot(
                msg.job_id, b.waiting.retry_after_s(now, slot_model(b, msg))))
            return
        job = b.ledger.jobs[msg.job_id]
        job.request_id = msg.request_id
        if not b.to_worker(slot.identity, raw):
            b.worker_died(slot.identity, "unreachable")
            b.to_frontend(ident, messages.NoSlot(msg.job_id,
                                                 timing.RETRY_AFTER_MIN_S))

    def on_done(self, slot, msg: messages.SlotDone, raw: list[bytes],
                now: float) -> None:
        """The worker's answer: to the frontend, and the slot is free."""
        b = self._broker
        if msg.job_id != slot.job_id:
            b.counters.stale_frames += 1
            return
        job = b.ledger.jobs[msg.job_id]
        b.to_frontend(job.frontend, raw)
        b.ledger.finish(job.job_id, now)
        if slot.draining:
            b.ledger.remove_worker(slot.identity)
        b.step_down.on_finish(slot.identity)


def slot_model(b: Broker, msg: messages.SlotAction) -> str:
    """The model of the slot an action names (for its Retry-After)."""
    return next((w.info.model for w in b.ledger.workers.values()
                 if w.slot_id == msg.id_slot), "")
