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


@dataclasses.dataclass
class HeldSubmit:
    job_id: str
    #: The worker the job was assigned to, and the SUBMIT's frames for it.
    worker: bytes
    frames: list[bytes]
    #: Workers still to step down, with the thread count each was told.
    waiting_on: dict[bytes, int]
    deadline: float


class HeldSubmits:
    """The SUBMITs waiting for step-downs, by job id. Pure bookkeeping: each
    method returns the held submits that may now go, and the broker sends
    them."""

    def __init__(self) -> None:
        self._held: dict[str, HeldSubmit] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, job_id: str, worker: bytes, frames: list[bytes],
             waiting_on: dict[bytes, int], deadline: float) -> None:
        self._held[job_id] = HeldSubmit(job_id, worker, frames,
                                        dict(waiting_on), deadline)

    def stepped_down(self, worker: bytes, n_threads: int) -> list[HeldSubmit]:
        """``worker`` now decodes with ``n_threads``."""
        return self._settle(lambda told: n_threads <= told, worker)

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
