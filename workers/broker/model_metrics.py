"""The pool's model-scoped series, one sample per model (issue 30).

Every series about a model's work carries a ``model`` label: its tokens,
requests and their times, its slots, its queue and its prompt caches. The
label is the model's name in the ledger (``Ready.model``, never an alias nor
a name a request gave), so the series are bounded by the models the broker
holds (``limits.MAX_MODELS``, and as many totals: ``pool_stats.PoolStats``).
A model that has no worker any more keeps its totals (a counter does not
drop while a model restarts) and reads 0 in its slot gauges.

The broker's own series (its peers, frames, CURVE, threads) are not about a
model and keep no label (``workers.broker.metrics``).

A job that named no model (an older frontend, or a pool with no worker at
all) and was refused is counted under ``model=""``, which Prometheus reads
as no label: no model was there to count it under.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from protocol.payloads import HistogramSnapshot, ModelTotals, PoolStatus, SlotStatus
from workers.broker.pool_stats import JobCounts

_BUSY = ("busy", "cancelling")
_NOT_LOADED = ("loading", "failed")

#: (series, help, ``ModelTotals`` field): the counters of a model's jobs.
JOB_COUNTERS = (
    ("llama_prompt_tokens_total", "Prompt tokens processed", "prompt_tokens_total"),
    ("llama_tokens_generated_total", "Tokens generated", "tokens_generated_total"),
    ("llama_request_success_total", "Jobs that ended with a finish",
     "request_success_total"),
    ("llama_request_fail_total", "Jobs that ended with an error",
     "request_fail_total"),
    ("llama_prompt_seconds_total", "Prompt processing time", "prompt_seconds_total"),
    ("llama_tokens_seconds_total", "Token generation time", "tokens_seconds_total"),
    ("llamapool_prompt_tokens_cached_total",
     "Prompt tokens served from a KV cache or a restored prompt state "
     "(usage.prompt_tokens_details.cached_tokens)", "prompt_tokens_cached_total"),
    ("llamapool_requests_cancelled_total", "Jobs that ended by acknowledged cancel",
     "request_cancelled_total"),
    ("llamapool_broker_no_slot_total",
     "SUBMITs the broker refused for lack of a slot of their model", "no_slot"),
    ("llamapool_queue_jobs_total", "Jobs that waited for a slot", "queued"),
)


def model_names(snap: PoolStatus) -> list[str]:
    """Every model the snapshot knows: in the ledger, or with totals."""
    names = {s.model for s in snap.slots} | {m.name for m in snap.models}
    names |= {m.name for m in snap.stats.models}
    return sorted(names)


def totals_by_model(snap: PoolStatus) -> dict[str, ModelTotals]:
    """Each model's totals, a model without any yet at 0 (its histograms
    too, so that a rate over them starts from a sample)."""
    known = {m.name: m for m in snap.stats.models}
    return {name: known.get(name) or JobCounts().model_totals(name)
            for name in model_names(snap)}


def slots_by_model(snap: PoolStatus) -> dict[str, list[SlotStatus]]:
    out: dict[str, list[SlotStatus]] = {name: [] for name in model_names(snap)}
    for slot in snap.slots:
        out[slot.model].append(slot)
    return out


def kv_cache_usage(slots: list[SlotStatus]) -> float:
    """Mean KV-cache fill of the busy ones of ``slots`` (0.0: none busy), as
    ``Ledger.kv_cache_usage`` counts the pool's."""
    levels = [min(1.0, (s.progress.n_ctx_used if s.progress else 0) / s.n_ctx)
              for s in slots if s.state in _BUSY and s.n_ctx > 0]
    return sum(levels) / len(levels) if levels else 0.0


def job_families(snap: PoolStatus) -> Iterator:
    """The counters and histograms of each model's jobs."""
    totals = totals_by_model(snap)
    for name, doc, field in JOB_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["model"])
        for model, t in totals.items():
            family.add_metric([model], getattr(t, field))
        yield family
    refused = CounterMetricFamily(
        "llamapool_queue_refused_total",
        "Jobs refused a wait or whose wait ended without a slot, by model and "
        "why (full: a bound; expired: the deadline; left: the client)",
        labels=["model", "reason"])
    for model, t in totals.items():
        for reason, value in (("full", t.queue_full), ("expired", t.queue_expired),
                              ("left", t.queue_left)):
            refused.add_metric([model, reason], value)
    yield refused
    for name, doc, field in (
            ("llamapool_disconnect_release_seconds",
             "From cancel (client gone) to the slot being free in the ledger",
             "cancel_release_s"),
            ("llamapool_queue_wait_seconds",
             "How long jobs that got a slot after waiting waited", "queue_wait_s")):
        family = HistogramMetricFamily(name, doc, labels=["model"])
        for model, t in totals.items():
            hist = getattr(t, field)
            if hist is not None:
                family.add_metric([model], _buckets(hist), hist.sum)
        yield family


def slot_families(snap: PoolStatus) -> Iterator:
    """Each model's slots and queue, from the ledger."""
    by_model = slots_by_model(snap)
    waiting = {m.name: m.jobs_waiting for m in snap.models}
    gauges = (
        ("llama_kv_cache_usage_level", "KV cache fill (0-1), mean over busy slots",
         kv_cache_usage),
        ("llama_slots_processing", "Slots running a job",
         lambda slots: sum(s.state in _BUSY for s in slots)),
        ("llamapool_slots_registered", "Slots in the pool (loaded)",
         lambda slots: sum(s.state not in _NOT_LOADED for s in slots)),
        ("llamapool_slots_busy", "Slots running a job",
         lambda slots: sum(s.state in _BUSY for s in slots)),
        ("llamapool_slots_alive", "Slots heard from within liveness", len),
        ("llamapool_slots_loading", "Workers still loading their model",
         lambda slots: sum(s.state in _NOT_LOADED for s in slots)),
    )
    for name, doc, value in gauges:
        family = GaugeMetricFamily(name, doc, labels=["model"])
        for model, slots in by_model.items():
            family.add_metric([model], value(slots))
        yield family
    depth = GaugeMetricFamily("llamapool_queue_depth",
                              "Jobs waiting for a slot (--queue-max)",
                              labels=["model"])
    for model in by_model:
        depth.add_metric([model], waiting.get(model, 0))
    yield depth
    family = GaugeMetricFamily(
        "llamapool_model_slots",
        "Slots in the ledger by model and state (idle, busy, cancelling, "
        "loading, failed)", labels=["model", "state"])
    counts = collections.Counter((s.model, s.state) for s in snap.slots)
    for (model, state), n in sorted(counts.items()):
        family.add_metric([model, state], n)
    yield family


def prompt_cache_families(snap: PoolStatus) -> Iterator:
    """The workers' prompt-state caches, summed over each model's slots in
    the ledger (each from its worker's last CACHE_REPORT). Hits, misses and
    evictions are the workers' own counters: a worker that leaves takes its
    share with it, which Prometheus reads as a counter reset."""
    by_model = {model: [s.prompt_cache for s in slots if s.prompt_cache is not None]
                for model, slots in slots_by_model(snap).items()}

    def family(kind, name: str, doc: str, field: str):
        out = kind(name, doc, labels=["model"])
        for model, caches in by_model.items():
            out.add_metric([model], sum(getattr(c, field) for c in caches))
        return out

    for name, doc in (
            ("hits", "Jobs that restored a saved prompt state"),
            ("misses", "Jobs of a block or more that found no cached prefix"),
            ("evictions", "Prompt states evicted to stay inside --cache-ram"),
            ("dropped", "Prompt states refused or dropped (larger than the "
             "limit, or failed to restore)")):
        yield family(CounterMetricFamily, f"llamapool_prompt_cache_{name}_total",
                     doc, name)
    yield family(GaugeMetricFamily, "llamapool_prompt_cache_bytes",
                 "Bytes of saved prompt states in the model's workers", "bytes_used")
    yield family(GaugeMetricFamily, "llamapool_prompt_cache_limit_bytes",
                 "Sum of the model's workers' --cache-ram limits", "bytes_limit")
    yield family(GaugeMetricFamily, "llamapool_prompt_cache_states",
                 "Saved prompt states in the model's workers", "states")


def _buckets(hist: HistogramSnapshot) -> list[tuple[str, int]]:
    """A ``HistogramSnapshot``'s buckets as prometheus_client takes them."""
    out = [(str(b), c) for b, c in zip(hist.buckets, hist.cumulative)]
    out.append(("+Inf", hist.cumulative[-1]))
    return out
