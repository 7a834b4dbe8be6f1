"""One pool-wide ledger from several brokers' STATUS replies.

With several brokers each keeps the ledger of the workers registered with it
(docs/operations.md, "Several brokers"). ``/health``, ``/slots``, ``/metrics`` and
``/v1/models`` must still show the whole pool, every worker once, so the
frontend merges the replies here.

* **Slot ids** are each ledger's own counter, so two brokers both have a
  slot 0. Broker ``i``'s ids are shown as ``i * SLOT_ID_STRIDE + id``: the
  first broker's ids are unchanged, and ``X-Slot-Id`` (rewritten the same way
  in ``frontend.broker_pool``) matches ``/slots``.
* **Once each.** A worker that moved to another broker stays in the old
  ledger until that broker's liveness window expires. The same worker
  (name, host, pid) is shown once, from the broker listed first; the totals
  are counted from the merged slots, so it is not counted twice either.
* **Totals** (``llama_*`` counters, the cancel-release histogram) are sums:
  each job ran through exactly one broker. The frontend count is the
  largest, not the sum: every frontend process registers with every broker.
* **Models** are merged by name: aliases together, the capabilities every
  broker's workers of it have (``frontend.model_resolution.catalog`` counts
  their slots again from the merged slots).
"""

from __future__ import annotations

import dataclasses

from protocol.payloads import (
    HistogramSnapshot,
    ModelStatus,
    ModelTotals,
    PoolStatus,
    PoolTotals,
    SlotStatus,
)

#: Broker ``i``'s slot ``n`` is shown as ``i * SLOT_ID_STRIDE + n``. A ledger
#: numbers slots with a counter that only grows with new registrations; a
#: million of them in one broker's life would make ids ambiguous.
SLOT_ID_STRIDE = 1_000_000

#: Slot states that hold a job (``workers.broker.ledger``).
_BUSY_STATES = ("busy", "cancelling")


def pool_slot_id(broker_index: int, slot_id: int) -> int:
    """The id a broker's slot has in the pool-wide view."""
    return broker_index * SLOT_ID_STRIDE + slot_id


def merge_statuses(replies: list[tuple[int, PoolStatus]]) -> PoolStatus | None:
    """One snapshot from ``(broker index, reply)`` pairs; None without any."""
    if not replies:
        return None
    if len(replies) == 1 and replies[0][0] == 0:
        return replies[0][1]  # one broker: its reply is the pool's
    replies = sorted(replies, key=lambda pair: pair[0])
    slots: list[SlotStatus] = []
    seen: set[tuple[str, str, int]] = set()
    duplicate_idle = 0
    for index, status in replies:
        for slot in status.slots:
            key = (slot.worker_name, slot.host, slot.pid)
            if key in seen:
                duplicate_idle += slot.state == "idle"
                continue
            seen.add(key)
            slots.append(dataclasses.replace(slot, id=pool_slot_id(index, slot.id)))
    statuses = [status for _, status in replies]
    busy = [s for s in statuses if s.slots_busy]
    n_busy = sum(s.slots_busy for s in busy)
    kv_level = (sum(s.kv_cache_usage_level * s.slots_busy for s in busy) / n_busy
                if n_busy else 0.0)
    counters: dict[str, int] = {}
    for status in statuses:
        for name, value in status.counters.items():
            counters[name] = counters.get(name, 0) + value
    # Like each ledger's own count: a failed (held) worker is no slot either.
    loading = sum(1 for s in slots if s.state in ("loading", "failed"))
    free = max(0, sum(s.slots_free for s in statuses) - duplicate_idle)
    full = [s.retry_after_s for s in statuses if s.slots_free == 0]
    return PoolStatus(
        slots=slots,
        slots_total=len(slots) - loading,
        slots_loading=loading,
        slots_busy=sum(1 for s in slots if s.state in _BUSY_STATES),
        slots_free=free,
        kv_cache_usage_level=kv_level,
        jobs=sum(s.jobs for s in statuses),
        frontends=max(s.frontends for s in statuses),
        counters=counters,
        stats=_sum_totals([s.stats for s in statuses]),
        # What a SUBMIT refused by every broker would be told: the soonest.
        retry_after_s=min(full) if full else min(s.retry_after_s for s in statuses),
        jobs_waiting=sum(s.jobs_waiting for s in statuses),
        models=merge_models([s.models for s in statuses]),
    )


def merge_models(per_broker: list[list[ModelStatus]]) -> list[ModelStatus]:
    """Each model once over the brokers (the first broker's order)."""
    merged: dict[str, ModelStatus] = {}
    for models in per_broker:
        for m in models:
            seen = merged.get(m.name)
            if seen is None:
                merged[m.name] = m
                continue
            merged[m.name] = ModelStatus(
                name=m.name,
                aliases=sorted(set(seen.aliases) | set(m.aliases)),
                capabilities=[c for c in seen.capabilities if c in m.capabilities]
                if seen.slots_total and m.slots_total
                else seen.capabilities or m.capabilities,
                n_ctx=min(n for n in (seen.n_ctx, m.n_ctx) if n) if (
                    seen.n_ctx or m.n_ctx) else 0,
                slots_total=seen.slots_total + m.slots_total,
                slots_idle=seen.slots_idle + m.slots_idle,
                slots_busy=seen.slots_busy + m.slots_busy,
                slots_loading=seen.slots_loading + m.slots_loading,
                jobs_waiting=seen.jobs_waiting + m.jobs_waiting)
    return list(merged.values())


#: Totals that are not sums over the brokers. ``n_tokens_max`` is a maximum
#: by nature. ``started_at_unix`` says when the counters began: the merged
#: counters drop when *any* broker restarts, so the newest start is the one
#: a scraper must see (llama.cpp's ``Process-Start-Time-Unix``).
_MAX_TOTALS = frozenset({"n_tokens_max", "started_at_unix"})


def _sum_totals(totals: list[PoolTotals]) -> PoolTotals:
    merged = {
        field.name: (max if field.name in _MAX_TOTALS else sum)(
            getattr(t, field.name) for t in totals)
        for field in dataclasses.fields(PoolTotals)
        if field.name not in ("cancel_release_s", "queue_wait_s", "models")
    }
    waits = [t.queue_wait_s for t in totals if t.queue_wait_s is not None]
    return PoolTotals(**merged, cancel_release_s=_sum_histograms(
        [t.cancel_release_s for t in totals]),
        queue_wait_s=_sum_histograms(waits) if waits else None,
        models=_sum_model_totals([m for t in totals for m in t.models]))


def _sum_model_totals(shares: list[ModelTotals]) -> list[ModelTotals]:
    """Each model's totals summed over the brokers (a model served through
    two brokers counts the jobs of both), by name."""
    by_name: dict[str, list[ModelTotals]] = {}
    for share in shares:
        by_name.setdefault(share.name, []).append(share)
    out = []
    for name, group in sorted(by_name.items()):
        merged = {
            field.name: (max if field.name == "n_tokens_max" else sum)(
                getattr(m, field.name) for m in group)
            for field in dataclasses.fields(ModelTotals)
            if field.name not in ("name", "cancel_release_s", "queue_wait_s")}
        hists = {}
        for field in ("cancel_release_s", "queue_wait_s"):
            present = [getattr(m, field) for m in group
                       if getattr(m, field) is not None]
            hists[field] = _sum_histograms(present) if present else None
        out.append(ModelTotals(name=name, **merged, **hists))
    return out


def _sum_histograms(hists: list[HistogramSnapshot]) -> HistogramSnapshot:
    first = hists[0]
    if any(h.buckets != first.buckets for h in hists):
        # Every broker of one release uses the same buckets; a mixed-version
        # pool shows the first broker's histogram rather than a wrong sum.
        return first
    recent = [x for h in hists for x in h.recent]
    ordered = sorted(recent)
    maxima = [h.max for h in hists if h.max is not None]
    return HistogramSnapshot(
        buckets=list(first.buckets),
        cumulative=[sum(col) for col in zip(*(h.cumulative for h in hists))],
        sum=sum(h.sum for h in hists),
        count=sum(h.count for h in hists),
        # From the newest observations of every broker, as each broker does
        # from its own.
        p50=ordered[len(ordered) // 2] if ordered else None,
        max=max(maxima) if maxima else None,
        recent=recent,
    )
