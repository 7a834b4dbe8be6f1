"""What the broker does with a SUBMIT: the slot of its model, or why not.

A job names its model (``GenerationRequest.model``, as the frontend resolved
it; an alias is resolved here too). It gets an idle slot of that model only,
its ``id_slot`` must be one of that model's, and a refusal's Retry-After is
counted from that model's busy slots: a model is full on its own, whatever
other models have free (issue 30). A model this broker has no worker of is
ERROR ``model_not_found`` and one whose workers all still load is ERROR
``loading_model``; neither takes a slot, and a frontend with other brokers
asks the next (``frontend.broker_pool``). A job that names no model (an
older frontend) gets any idle slot, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import messages
from protocol.errors import ErrorCode
from protocol.prefix import MAX_BLOCKS

if TYPE_CHECKING:
    from workers.broker.broker import Broker


class SubmitAdmission:
    """``Broker``'s SUBMIT handler (its ledger's assignment, by model)."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def on_submit(self, ident: bytes, msg: messages.Submit, raw: list[bytes],
                  now: float) -> None:
        b = self._broker
        b.counters.submitted += 1
        if msg.job_id in b.ledger.jobs or msg.job_id in b.waiting.room:
            b.to_frontend(ident, messages.Error(
                msg.job_id, ErrorCode.DUPLICATE_JOB, "duplicate job id"))
            return
        model = self._model_of(ident, msg)
        if model is None:
            return
        limited = b.key_accounts.over_limit(
            msg, now, lambda: b.waiting.retry_after_s(now, model))
        if limited is not None:  # its key's limit (``key_limits``): 429
            b.to_frontend(ident, limited)
            return
        if b.waiting.room.waiters:
            # Slots freed earlier in this turn of the broker's loop (workers
            # are read before frontends) freed while only the waiters were
            # there: they go by the room's rule first, so a newcomer never
            # overtakes a job that waited.
            b.waiting.serve(now)
        blocks = msg.prefix_blocks[:MAX_BLOCKS]
        if msg.id_slot == -1:
            slot = b.ledger.assign(msg.job_id, ident, now, blocks, model)
        else:
            try:
                slot = b.ledger.assign_slot(msg.id_slot, msg.job_id, ident, now,
                                            blocks, model)
            except KeyError:
                # llama.cpp's words for a slot it does not have.
                b.to_frontend(ident, messages.Error(
                    msg.job_id, ErrorCode.INVALID_SLOT, "Invalid slot ID"))
                return
        if slot is None:
            if b.waiting.wait(ident, msg, raw, blocks, now):
                return
            b.counters.no_slot += 1
            b.stats.of(model).no_slot += 1
            b.key_accounts.on_no_slot(msg)
            b.to_frontend(ident, messages.NoSlot(
                msg.job_id, b.waiting.retry_after_s(now, model)))
            return
        b.start_job(ident, msg, raw, slot, now)

    def _model_of(self, ident: bytes, msg: messages.Submit) -> str | None:
        """The model the job's slot must serve ("": any), or None once the
        job was answered with ERROR (no such model, or only loading)."""
        b = self._broker
        asked = msg.request.model
        if not asked:
            return ""
        model = b.ledger.models.resolve(asked)
        if model is None:
            b.counters.model_not_found += 1
            b.to_frontend(ident, messages.Error(
                msg.job_id, ErrorCode.MODEL_NOT_FOUND,
                f"model '{asked[:200]}' not found"))
            return None
        if b.ledger.live_slots(model) == 0:
            b.counters.model_loading += 1
            b.to_frontend(ident, messages.Error(
                msg.job_id, ErrorCode.LOADING_MODEL, "Loading model"))
            return None
        return model
