"""How many llama.cpp threads each busy ``--threads auto`` worker may use.

A host gives the pool some cores (``--pool-cores``, sent in READY). The busy
workers on that host share them: ``pool_cores // busy`` each, the remainder
going one by one to the lowest slot ids, and never fewer than 1. A lone job
gets every core; two jobs on a 2-core host get one each.

Why the broker decides, not the workers on a host among themselves: the
broker's ledger already knows, the moment it assigns a job and the moment a
terminal frame frees a slot, which workers are busy and on which host. It can
tell the running workers to step down *before* it hands the new job over
(THREADS is sent ahead of the SUBMIT, and each DEALER pipe is ordered), so a
running worker steps down within one token of the new job's first decode.
Workers agreeing among themselves would need a second channel per host
(shared memory or a lock file), a host identity they agree on, and cleanup
when one dies; all of that the ledger has for free. The cost: a worker whose
broker is gone keeps its last budget until a broker tells it another one.

Workers with a fixed ``--threads`` count as busy (they do use cores) but are
never told anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.broker.ledger import BUSY, CANCELLING, WorkerSlot


def budgets(workers: Iterable[WorkerSlot]) -> dict[bytes, int]:
    """Thread count for every busy auto worker, by identity."""
    busy_by_host: dict[str, list[WorkerSlot]] = {}
    for w in workers:
        if w.state in (BUSY, CANCELLING):
            busy_by_host.setdefault(w.info.host, []).append(w)
    out: dict[bytes, int] = {}
    for busy in busy_by_host.values():
        busy.sort(key=lambda w: w.slot_id)
        n = len(busy)
        for rank, w in enumerate(busy):
            cores = w.info.pool_cores
            if cores <= 0:
                continue  # fixed --threads: not ours to change
            out[w.identity] = max(1, cores // n + (1 if rank < cores % n else 0))
    return out
