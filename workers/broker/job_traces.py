"""The broker's spans of a traced job: placement, the step-down hold, cancel.

Made only when tracing is on (``protocol.tracing``) and the SUBMIT carries
the frontend's context (``messages.Submit.trace``), as children of the
frontend's ``frontend.job`` span:

* ``broker.placement``: from the SUBMIT's arrival to the broker's answer:
  the worker chosen (slot, name, host), the prefix blocks the prompt has and
  how many that worker holds, and whether the SUBMIT is held for a
  ``--threads auto`` step-down;
* ``broker.queue_wait``: a job that found no slot and waits for one
  (``--queue-max``): from its QUEUED to the slot it got, its deadline or its
  client leaving (``llamapool.queue_outcome``), with its position at entry;
  the slot's attributes as ``broker.placement`` has them when it got one;
* ``broker.step_down_hold``: from that hold to the SUBMIT going out;
* ``broker.cancel``: from a CANCEL (the client gone, or its frontend) to the
  terminal frame that frees the slot, the time DESIGN.md has measured.

The broker's loop is single-threaded, so no lock. A traced job's open spans
are kept until its terminal frame or its failure, whichever the broker sees
(both end every job in the ledger).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from protocol import messages, otel_sdk, tracing

if TYPE_CHECKING:
    from workers.broker.broker import Broker
    from workers.broker.ledger import Job


@dataclasses.dataclass
class _OpenJob:
    parent: Context
    hold: trace.Span | None = None
    cancel: trace.Span | None = None
    queue: trace.Span | None = None


class BrokerTraces:
    """The spans of the traced jobs in the broker's ledger."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._open: dict[str, _OpenJob] = {}

    def on_submit(self, ident: bytes, msg: messages.Submit, now: float) -> None:
        """After the broker answered a SUBMIT that arrived at ``now``."""
        parent = otel_sdk.job_parent(msg.trace)
        if parent is None:
            return
        b = self._broker
        job = b.ledger.jobs.get(msg.job_id)
        placed = job is not None and job.frontend == ident
        attrs: dict[str, Any] = {
            "llamapool.job_id": msg.job_id,
            "llamapool.request_id": msg.request_id,
            "llamapool.id_slot": msg.id_slot,
            "llamapool.prefix_blocks": len(msg.prefix_blocks),
            "llamapool.placed": placed,
        }
        waiter = b.waiting.room.waiters.get(msg.job_id)
        attrs["llamapool.queued"] = waiter is not None
        if placed:
            attrs.update(self._slot_attrs(job))
        started = otel_sdk.wall_ns(now)
        span = tracing.TRACER.start_span("broker.placement", context=parent,
                                         start_time=started, attributes=attrs)
        span.end()
        if placed:
            self._open[msg.job_id] = _OpenJob(parent, hold=self._hold(job, parent,
                                                                      started))
        elif waiter is not None:
            self._open[msg.job_id] = _OpenJob(parent, queue=tracing.TRACER.start_span(
                "broker.queue_wait", context=parent, start_time=started,
                attributes={"llamapool.job_id": msg.job_id,
                            "llamapool.queue_position": b.waiting.room.position(waiter),
                            "llamapool.queue_depth": len(b.waiting.room)}))

    def _slot_attrs(self, job: Job) -> dict[str, Any]:
        """The slot ``job`` got, and whether its SUBMIT is held for a step-down."""
        b = self._broker
        attrs: dict[str, Any] = {}
        slot = b.ledger.workers.get(job.worker)
        if slot is not None:
            attrs.update({
                "llamapool.slot_id": slot.slot_id,
                "llamapool.worker": slot.info.worker_name,
                "llamapool.worker_host": slot.info.host,
                "llamapool.prefix_blocks_held": slot.shared_blocks_at_assign,
            })
        attrs["llamapool.step_down_held"] = b.step_down.holds(job.job_id)
        return attrs

    def _hold(self, job: Job, parent: Context, started: int) -> trace.Span | None:
        if not self._broker.step_down.holds(job.job_id):
            return None
        return tracing.TRACER.start_span("broker.step_down_hold", context=parent,
                                         start_time=started)

    def on_dequeued(self, job_id: str, outcome: str, now: float) -> None:
        """A waiting job left the queue: ``started`` (it got a slot, now in
        the ledger), ``expired`` (NO_SLOT at its deadline) or ``left`` (its
        client or its frontend went)."""
        open_job = self._open.get(job_id)
        if open_job is None or open_job.queue is None:
            return
        span, open_job.queue = open_job.queue, None
        span.set_attribute("llamapool.queue_outcome", outcome)
        job = self._broker.ledger.jobs.get(job_id)
        if outcome == "started" and job is not None:
            span.set_attributes(self._slot_attrs(job))
            open_job.hold = self._hold(job, open_job.parent, otel_sdk.wall_ns(now))
        else:
            self._open.pop(job_id, None)
            if outcome == "expired":
                span.set_status(Status(StatusCode.ERROR, "no slot before the deadline"))
        span.end(end_time=otel_sdk.wall_ns(now))

    def on_hold_ended(self, job_id: str) -> None:
        """The job's held SUBMIT went out (or was dropped with its job)."""
        open_job = self._open.get(job_id)
        if open_job is not None and open_job.hold is not None:
            open_job.hold.end()
            open_job.hold = None

    def on_cancel(self, job: Job, now: float) -> None:
        """The broker sent CANCEL for ``job``."""
        open_job = self._open.get(job.job_id)
        if open_job is not None and open_job.cancel is None:
            open_job.cancel = tracing.TRACER.start_span(
                "broker.cancel", context=open_job.parent,
                start_time=otel_sdk.wall_ns(now),
                attributes={"llamapool.job_id": job.job_id})

    def on_finish(self, job: Job, msg: messages.Message) -> None:
        """``job``'s terminal frame passed: its slot is free."""
        attrs: dict[str, Any] = {"llamapool.frame": type(msg).__name__.lower()}
        if isinstance(msg, messages.Final):
            attrs["gen_ai.response.finish_reasons"] = (msg.finish_reason,)
        elif isinstance(msg, messages.Error):
            attrs["error.type"] = str(msg.code)
        self._close(job.job_id, attrs, error=None)

    def on_failed(self, job: Job, code: str) -> None:
        """The broker ended ``job`` itself (its worker died or broke it)."""
        self._close(job.job_id, {"error.type": code}, error=code)

    def _close(self, job_id: str, attrs: dict[str, Any], error: str | None) -> None:
        open_job = self._open.pop(job_id, None)
        if open_job is None:
            return
        end = time.time_ns()
        for span in (open_job.queue, open_job.hold, open_job.cancel):
            if span is not None:
                span.set_attributes(attrs)
                if error is not None:
                    span.set_status(Status(StatusCode.ERROR, error))
                span.end(end_time=end)
