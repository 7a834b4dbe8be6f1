"""New jobs wait until the running workers on their host have stepped down.

With ``--threads auto`` a lone job decodes with every core of its host. When
a second job lands there, the first must drop to its share *before* the
second starts: llama.cpp's threads meet at a barrier after every operation,
so a decode whose threads outnumber the free cores does not run a little
slower, it stalls (measured: one such token took 179 ms at p50 and 752 ms at
worst, against about 15 ms normally; BENCHMARKS.md section 10).

So the broker sends THREADS to the workers that must step down and holds the
new job's SUBMIT until each of them answers THREADS_SET (sent by the worker's
decode loop once the new count is in force, that is within one token), its
job ends, or it dies. The new job pays at most one token of the running
jobs' decode in TTFT; nobody pays an oversubscribed token.

A worker in the middle of a long prompt batch cannot switch before the batch
ends, so the hold is bounded (the broker's ``step_down_wait_s``, 0.25 s by
default: about ten tokens of the default model at two threads): after that
the SUBMIT goes anyway (counted), trading a short oversubscription for a
bounded TTFT.

The lease is taken when the job is assigned, not when the SUBMIT is sent, so
a held job's slot is never offered twice, and the 503 rule is untouched.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

from protocol import messages
from workers.broker.thread_budget import budgets

if TYPE_CHECKING:
    from workers.broker.broker import Broker


class Told(NamedTuple):
    """The THREADS a worker was sent: its count and sequence number."""

    n_threads: int
    seq: int


@dataclasses.dataclass
class HeldSubmit:
    job_id: str
    #: The worker the job was assigned to, and the SUBMIT's frames for it.
    worker: bytes
    frames: list[bytes]
    #: Workers still to step down, with the THREADS each was told.
    waiting_on: dict[bytes, Told]
    deadline: float


class HeldSubmits:
    """The SUBMITs waiting for step-downs, by job id. Pure bookkeeping: each
    method returns the held submits that may now go, and the broker sends
    them."""

    def __init__(self) -> None:
        self._held: dict[str, HeldSubmit] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._held

    def hold(self, job_id: str, worker: bytes, frames: list[bytes],
             waiting_on: dict[bytes, Told], deadline: float) -> None:
        self._held[job_id] = HeldSubmit(job_id, worker, frames,
                                        dict(waiting_on), deadline)

    def stepped_down(self, worker: bytes, n_threads: int, seq: int) -> list[HeldSubmit]:
        """``worker`` now decodes with no more than ``n_threads``, the answer
        to its THREADS number ``seq``. An answer to an older THREADS than
        the one a hold waits for says nothing about that one."""
        return self._settle(
            lambda told: seq >= told.seq and n_threads <= told.n_threads, worker)

    def worker_idle(self, worker: bytes) -> list[HeldSubmit]:
        """``worker``'s job ended or the worker is gone: it decodes nothing."""
        return self._settle(lambda told: True, worker)

    def release(self, job_id: str) -> HeldSubmit | None:
        """Take one job out now (it is being cancelled: its SUBMIT must reach
        the worker ahead of the CANCEL)."""
        return self._held.pop(job_id, None)

    def due(self, now: float) -> list[HeldSubmit]:
        """The held submits whose wait is over."""
        out = [h for h in self._held.values() if h.deadline <= now]
        for h in out:
            del self._held[h.job_id]
        return out

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._held.values()), default=None)

    def _settle(self, satisfied, worker: bytes) -> list[HeldSubmit]:
        out = []
        for h in list(self._held.values()):
            told = h.waiting_on.get(worker)
            if told is not None and satisfied(told):
                del h.waiting_on[worker]
                if not h.waiting_on:
                    del self._held[h.job_id]
                    out.append(h)
        return out


class ThreadStepDown:
    """The broker's ``--threads auto`` policy: each busy worker's share of
    its host's cores (``workers.broker.thread_budget``), told with THREADS
    whenever it changes, and a new job's SUBMIT held until the running
    workers it displaces have stepped down (this module's docstring)."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._held = HeldSubmits()

    def __bool__(self) -> bool:
        return bool(self._held)

    def next_deadline(self) -> float | None:
        return self._held.next_deadline()

    def holds(self, job_id: str) -> bool:
        """Whether the job's SUBMIT is held (for its trace)."""
        return job_id in self._held

    def on_assign(self, job_id: str, worker: bytes, frames: list[bytes],
                  now: float) -> bool:
        """Before a job's SUBMIT goes to ``worker``: the new worker learns its
        own share first, and the host's running workers step down. True if
        the SUBMIT is held for them (it goes when they have)."""
        stepping_down = self.retune()
        stepping_down.pop(worker, None)
        wait_s = self._broker.settings.step_down_wait_s
        if not stepping_down or wait_s <= 0:
            return False
        self._broker.counters.submits_held_for_step_down += 1
        self._held.hold(job_id, worker, frames, stepping_down, now + wait_s)
        return True

    def on_due(self, now: float) -> None:
        held = self._held.due(now)
        self._broker.counters.step_down_waits_expired += len(held)
        self._send(held)

    def stepped_down(self, worker: bytes, n_threads: int, seq: int) -> None:
        self._send(self._held.stepped_down(worker, n_threads, seq))

    def release(self, job_id: str) -> None:
        """Send a held SUBMIT now: its job is cancelled, and the worker must
        have it before the CANCEL."""
        self._send([self._held.release(job_id)])

    def on_finish(self, worker: bytes) -> None:
        self._send(self._held.worker_idle(worker))
        self.retune()  # the host's other busy workers step up

    def on_worker_gone(self, worker: bytes) -> None:
        self._send(self._held.worker_idle(worker))

    def on_beat(self, now: float) -> None:
        # Also catches busy workers that died or left since the last change.
        self.retune()

    def retune(self) -> dict[bytes, Told]:
        """Send THREADS to each busy ``--threads auto`` worker whose share
        changed. Returns the workers told to use fewer threads than before,
        with the THREADS each was told."""
        b = self._broker
        stepping_down: dict[bytes, Told] = {}
        for ident, n_threads in budgets(b.ledger.workers.values()).items():
            slot = b.ledger.workers[ident]
            # Never told: the worker loaded with all its host's pool cores.
            current = slot.threads_told or slot.info.pool_cores
            if current != n_threads:
                slot.threads_told = n_threads
                slot.threads_seq += 1
                b.to_worker(ident, messages.Threads(n_threads, slot.threads_seq))
                if n_threads < current:
                    stepping_down[ident] = Told(n_threads, slot.threads_seq)
        return stepping_down

    def _send(self, held: list[HeldSubmit | None]) -> None:
        """Send the SUBMITs whose wait is over, if their job is still the one
        assigned to that worker."""
        b = self._broker
        for h in held:
            if h is None:
                continue
            if b.traces is not None:
                b.traces.on_hold_ended(h.job_id)
            job = b.ledger.jobs.get(h.job_id)
            if job is None or job.worker != h.worker:
                continue  # failed or ended meanwhile (its worker died)
            if not b.to_worker(h.worker, h.frames):
                b.worker_died(h.worker, "unreachable")
