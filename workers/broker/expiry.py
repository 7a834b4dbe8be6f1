"""Peers that hold the broker's resources without using them: workers that
never start a job they were given, workers that never end a job they were
told to cancel, frontends that never read.

Both are checked outside the message handlers (a frontend is never dropped in
the middle of handling one of its messages), and both end with the job's
terminal frame or cancel, so the ledger stays whole.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from protocol import messages
from protocol.errors import ErrorCode

if TYPE_CHECKING:
    from workers.broker.broker import Broker

log = logging.getLogger("llamapool.broker")


class MuteJobs:
    """Fail jobs whose worker showed no sign of them in time, and drop that
    worker (``first_frame_timeout_s``: a fake or wedged worker)."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def on_beat(self, now: float) -> None:
        b = self._broker
        deadline = now - b.settings.first_frame_timeout_s
        mute = [job for job in b.ledger.jobs.values()
                if not job.heard and job.submitted_at < deadline]
        for job in mute:
            slot = b.ledger.workers.get(job.worker)
            b.counters.worker_unresponsive += 1
            b.log.warning(
                "worker unresponsive",
                "worker unresponsive: no sign of %s for %.0fs; dropped "
                "(slot=%s pid=%s host=%s)", job.named(),
                b.settings.first_frame_timeout_s,
                getattr(slot, "slot_id", "?"),
                slot.info.pid if slot else "?", slot.info.host if slot else "?")
            orphan = b.ledger.remove_worker(job.worker)
            b.to_worker(job.worker, messages.Disconnect("no sign of the job"))
            if orphan is not None:
                b.stats.job_lost(orphan.model)
                b.fail_job(orphan, ErrorCode.WORKER_UNRESPONSIVE,
                           "the model worker did not start the job in time")


class StuckCancels:
    """Drop a worker that has not ended a job it was told to cancel within
    ``cancel_timeout_s`` (``workers.broker.settings``).

    A worker checks its cancel at every token, so one still ``cancelling``
    after that is stuck inside one native call (issue 29: a grammar whose
    stacks explode held one for good). Its slot leaves the ledger, so free
    slots equal live workers again, and it comes back only when the worker
    registers again: the worker keeps the same deadline and ends its own
    process (``workers.model.worker_link``) for its supervisor to start a
    fresh one. The job's frontend, if still there, gets ERROR
    ``worker_unresponsive``; the log line names the job, its request and key.
    """

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def on_beat(self, now: float) -> None:
        b = self._broker
        timeout_s = b.settings.cancel_timeout_s
        deadline = now - timeout_s
        stuck = [job for job in b.ledger.jobs.values()
                 if job.cancel_requested_at is not None
                 and job.cancel_requested_at < deadline]
        for job in stuck:
            b.counters.worker_cancel_timeouts += 1
            b.to_worker(job.worker, messages.Disconnect(
                "a cancelled job not ended in time"))
            b.worker_died(
                job.worker,
                f"cancelled {now - job.cancel_requested_at:.1f}s ago and not "
                f"ended (--cancel-timeout-s {timeout_s:g}): stuck",
                code=ErrorCode.WORKER_UNRESPONSIVE,
                message="the model worker did not end the cancelled job in time")


class StuckFrontends:
    """A frontend whose pipe is full does not read: frozen or hostile. A real
    one reads everything at once (``workers.broker.broker``'s docstring), so
    it is treated as gone; if it was only frozen it hears DISCONNECT on its
    next message and registers again, failing the jobs it held."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        #: Frontends whose send pipe was full, to drop after the current
        #: message.
        self.found: set[bytes] = set()

    def drop(self) -> None:
        if not self.found:
            return
        b = self._broker
        now = time.monotonic()
        for ident in self.found:
            if ident in b.ledger.frontends:
                b.counters.frontend_send_full += 1
                b.log.warning("frontend lost", "frontend lost (send queue full): %s",
                              ident[:16].hex())
                b.frontend_gone(ident, now)
        self.found.clear()
