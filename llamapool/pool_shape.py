"""How many workers ``llamapool up`` starts, and how many slots each holds,
when ``--workers`` and ``--slots-per-worker`` are not given.

The default pool has two slots. Whether they are two one-slot workers or
one worker of two batched slots depends on whether a decode step of two
sequences costs much less than two steps of one on this CPU (each step
reads all the weights once, whatever it carries):

* on an Intel Xeon with AMX (and AVX-512), it does: one batched worker of
  two slots gave 1.4-1.55× the tokens/s of two one-slot workers at
  concurrency 2 and the same at concurrency 1
  (docs/benchmarks/22-batched-one-ubatch.md);
* on the AMD EPYC (AVX2) measured, it does not: llama.cpp's decode step of
  two or three sequences took two or three times one's (37.2 and 56.8
  against 18.7 ms; four took 45), so one batched worker of two slots gave
  0.79-0.96× the tokens/s of two one-slot workers at concurrency 2
  (docs/benchmarks/24-amd-epyc-rerun.md). One-slot workers stay the default
  there and on every CPU not measured.

Either flag given keeps the other at its plain default (2 workers, 1 slot
each): a pool sized on purpose is not reshaped. So do a models file (each
model has its own count of workers), ``--gpus`` (one worker per device, a
shape not measured here), an engine other than llama.cpp, and ``--threads
auto`` (batched slots need a fixed thread count), which only a one-slot
worker runs.
"""

from __future__ import annotations

import dataclasses

from workers.model.weight_repack import cpu_flags, cpu_has_amx

#: ``--workers`` when neither flag is given on a CPU without a measured
#: gain from batching, and whenever ``--slots-per-worker`` alone is given.
DEFAULT_WORKERS = 2


@dataclasses.dataclass(frozen=True)
class PoolShape:
    workers: int
    slots_per_worker: int
    #: Why, for the log: "given", or what the host's CPU chose.
    reason: str


def pool_shape(workers: int | None, slots_per_worker: int | None, *,
               models_file: bool = False, gpus: bool = False,
               engine: str = "llama.cpp",
               threads: str | None = None,
               flags: frozenset[str] | None = None) -> PoolShape:
    """The pool's shape from ``up``'s flags (None: not given) and this CPU's
    flags (``/proc/cpuinfo``'s when None); the module doc says why."""
    if (workers is not None or slots_per_worker is not None or models_file
            or gpus or engine != "llama.cpp" or threads == "auto"):
        return PoolShape(workers or DEFAULT_WORKERS, slots_per_worker or 1, "given")
    if cpu_has_amx(cpu_flags() if flags is None else flags):
        return PoolShape(1, 2, "auto: batched slots pay on this AMX CPU")
    return PoolShape(DEFAULT_WORKERS, 1, "auto: one slot per worker on this CPU")
