"""A job's frames from its worker to its frontend, and what a broken one costs.

TOKEN is nearly every frame the broker sees, and decoding one cost about a
sixth of the broker's CPU per frame (BENCHMARKS.md section 13). So a TOKEN of
the job its worker holds is relayed without decoding its body:
``messages.is_token_of`` checks what routing needs, the command and that the
body names that job, so a frame never reaches another job's client. The
frontend decodes every frame anyway and checks the rest; a broken TOKEN
comes back as a CANCEL that says so (``on_broken_job``), and is then handled
as a broken frame found here is: the job fails with
``worker_protocol_error`` and the worker is disconnected, not trusted with
the next job until it registers again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protocol import messages
from protocol.errors import ErrorCode
from workers.broker import ledger as ledger_mod

if TYPE_CHECKING:
    from workers.broker.broker import Broker

log = logging.getLogger("llamapool.broker")


class JobRelay:
    """The relay and its repair, on the broker's ledger and sockets."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def relay_token(self, identity: bytes, body: list[bytes], now: float) -> bool:
        """Relay a TOKEN of the job its worker holds without decoding it;
        False (nothing done) for any other frame, which is decoded as usual."""
        b = self._broker
        slot = b.ledger.touch_worker(identity, now)
        if slot is None or slot.job_id is None:
            return False
        job = b.ledger.jobs[slot.job_id]
        if not messages.is_token_of(body, job.tag):
            return False
        b.counters.tokens_relayed += 1
        self.relay(job, body, now)
        return True

    def relay(self, job: ledger_mod.Job, frames: list[bytes], now: float) -> None:
        """Pass one of the job's TOKEN frames to its frontend, decoded or not."""
        job.heard = True
        if not self._broker.to_frontend(job.frontend, frames):
            # Its frontend is gone: stop the work instead of computing
            # tokens nobody will read.
            self._broker.cancel(job.frontend, job.job_id, now)

    def on_malformed_from_worker(self, identity: bytes, why: str,
                                 frames: list[bytes]) -> None:
        """Drop and count, as from any peer; and if a registered worker's
        broken frame was a job frame while it holds a job, that job can no
        longer end well: its output or its terminal frame is lost. A broken
        heartbeat is only dropped: it loses nothing."""
        b = self._broker
        b.malformed(identity, why)
        slot = b.ledger.workers.get(identity)
        if (slot is None or slot.job_id is None
                or messages.command_class(frames)
                not in (*messages.JOB_FRAMES, messages.SlotDone)):
            return
        self._worker_broke_job(slot, why)

    def on_broken_job(self, frontend: bytes, job_id: str, why: str) -> None:
        """The frontend found a TOKEN of this job broken (a CANCEL that says
        so): counted and handled as if the broker had found it."""
        b = self._broker
        job = b.ledger.jobs.get(job_id)
        if job is None or job.frontend != frontend:
            return  # already over, or not this frontend's to judge
        slot = b.ledger.workers.get(job.worker)
        if slot is None or slot.job_id != job_id:
            return
        b.malformed(job.worker, f"(found by the frontend) {why}")
        self._worker_broke_job(slot, why)

    def _worker_broke_job(self, slot: ledger_mod.WorkerSlot, why: str) -> None:
        b = self._broker
        b.counters.worker_protocol_errors += 1
        log.warning("worker sent a malformed job frame mid-job: slot=%d pid=%d: "
                    "%s; failing its job and disconnecting it",
                    slot.slot_id, slot.info.pid, why[:200])
        job = b.ledger.remove_worker(slot.identity)
        if job is not None:
            b.stats.job_lost(job.model)
            b.fail_job(job, ErrorCode.WORKER_PROTOCOL_ERROR,
                        "the model worker sent a malformed frame")
        b.to_worker(slot.identity, messages.Disconnect("malformed job frame"))
