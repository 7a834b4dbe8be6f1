"""The broker's ledger and pool totals as Prometheus metric families.

Rendered from a broker snapshot (``Broker.snapshot``), either by a frontend's
``/metrics`` (snapshot fetched over ZeroMQ) or by the broker's own
``--metrics-port`` endpoint.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from protocol.payloads import PoolStatus
from workers.broker.counters import BrokerCounters
from workers.broker.key_metrics import key_usage_families


class PoolCollector:
    """Renders one broker snapshot as metric families (per scrape)."""

    def __init__(self, snapshot: PoolStatus) -> None:
        self.snapshot = snapshot

    def collect(self):
        # Long, and exempt from the 80-line rule on purpose: one flat list of
        # series, each its name, help and value; split, it would only be
        # harder to find one.
        snap = self.snapshot
        stats = snap.stats
        counters = BrokerCounters.from_dict(snap.counters)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("llama_prompt_tokens_total", "Prompt tokens processed",
                      stats.prompt_tokens_total)
        yield counter("llama_tokens_generated_total", "Tokens generated",
                      stats.tokens_generated_total)
        yield counter("llama_request_success_total", "Jobs that ended with a finish",
                      stats.request_success_total)
        yield counter("llama_request_fail_total", "Jobs that ended with an error",
                      stats.request_fail_total)
        yield counter("llama_prompt_seconds_total", "Prompt processing time",
                      stats.prompt_seconds_total)
        yield counter("llama_tokens_seconds_total", "Token generation time",
                      stats.tokens_seconds_total)
        yield counter("llamapool_prompt_tokens_cached_total",
                      "Prompt tokens served from a KV cache or a restored "
                      "prompt state (usage.prompt_tokens_details.cached_tokens)",
                      stats.prompt_tokens_cached_total)
        yield from prompt_cache_families(snap)
        yield from model_slot_families(snap)
        yield from key_usage_families(snap)
        yield gauge("llama_kv_cache_usage_level",
                    "KV cache fill (0-1), mean over busy slots",
                    snap.kv_cache_usage_level)
        yield gauge("llama_slots_processing", "Slots running a job",
                    snap.slots_busy)
        yield gauge("llamapool_slots_registered", "Slots in the pool (loaded)",
                    snap.slots_total)
        yield gauge("llamapool_slots_busy", "Slots running a job", snap.slots_busy)
        yield gauge("llamapool_slots_alive", "Slots heard from within liveness",
                    snap.slots_total + snap.slots_loading)
        yield gauge("llamapool_slots_loading", "Workers still loading their model",
                    snap.slots_loading)
        yield counter("llamapool_requests_cancelled_total",
                      "Jobs that ended by acknowledged cancel",
                      stats.request_cancelled_total)
        yield counter("llamapool_broker_no_slot_total",
                      "SUBMITs the broker refused for lack of a slot",
                      counters.no_slot)
        yield counter("llamapool_worker_deaths_total", "Workers the broker lost",
                      counters.worker_deaths)
        yield counter("llamapool_worker_restarts_total",
                      "Workers that registered on a host after one died there",
                      counters.worker_restarts)
        yield counter("llamapool_broker_malformed_frames_dropped_total",
                      "Malformed ZeroMQ messages the broker dropped",
                      counters.malformed_dropped)
        yield counter("llamapool_broker_workers_refused_total",
                      "Worker registrations refused: the pool was full "
                      "(--max-workers)",
                      counters.worker_refused_full)
        yield counter("llamapool_broker_workers_unresponsive_total",
                      "Workers dropped for showing no sign of a job in time "
                      "(--first-frame-timeout-s); each job got an error",
                      counters.worker_unresponsive)
        yield counter("llamapool_broker_cancel_timeouts_total",
                      "Workers dropped for not ending a cancelled job within "
                      "--cancel-timeout-s (stuck in native code); each ends "
                      "its own process",
                      counters.worker_cancel_timeouts)
        yield counter("llamapool_broker_cache_claims_failed_total",
                      "Jobs placed by a worker's cache claim that then reused "
                      "less than it claimed",
                      counters.cache_claims_failed)
        yield counter("llamapool_broker_workers_distrusted_total",
                      "Times a worker's cache claims stopped steering routing "
                      "after they failed",
                      counters.workers_distrusted)
        yield counter("llamapool_broker_frontends_send_full_total",
                      "Frontends dropped because they did not read what the "
                      "broker sent (their send queue was full)",
                      counters.frontend_send_full)
        yield counter("llamapool_broker_unknown_peer_total",
                      "Messages from unregistered peers, answered with DISCONNECT",
                      counters.unknown_peer)
        yield counter("llamapool_broker_curve_refused_total",
                      "Peers refused at the CURVE handshake (key not authorized)",
                      counters.curve_refused)
        yield counter("llamapool_broker_curve_revoked_peers_total",
                      "Open connections dropped because their CURVE key was "
                      "revoked after the handshake",
                      counters.curve_revoked_peers)
        yield counter("llamapool_broker_submits_held_for_step_down_total",
                      "SUBMITs held until --threads auto workers on the same "
                      "host stepped down",
                      counters.submits_held_for_step_down)
        yield counter("llamapool_broker_step_down_waits_expired_total",
                      "Held SUBMITs sent before every step-down was confirmed "
                      "(a worker was inside a long prompt batch)",
                      counters.step_down_waits_expired)
        yield HistogramMetricFamily(
            "llamapool_disconnect_release_seconds",
            "From cancel (client gone) to the slot being free in the ledger",
            buckets=_buckets(stats.cancel_release_s),
            sum_value=stats.cancel_release_s.sum,
        )
        yield gauge("llamapool_queue_depth",
                    "Jobs waiting for a slot (--queue-max)", snap.jobs_waiting)
        if stats.queue_wait_s is not None:
            yield HistogramMetricFamily(
                "llamapool_queue_wait_seconds",
                "How long jobs that got a slot after waiting waited",
                buckets=_buckets(stats.queue_wait_s),
                sum_value=stats.queue_wait_s.sum)
        yield counter("llamapool_queue_jobs_total",
                      "Jobs that waited for a slot", counters.queued)
        family = CounterMetricFamily(
            "llamapool_queue_refused_total",
            "Jobs refused a wait or whose wait ended without a slot, by why "
            "(full: a bound; expired: the deadline; left: the client)",
            labels=["reason"])
        for reason, value in (("full", counters.queue_full),
                              ("expired", counters.queue_expired),
                              ("left", counters.queue_left)):
            family.add_metric([reason], value)
        yield family


def _buckets(hist) -> list[tuple[str, int]]:
    """A ``HistogramSnapshot``'s buckets as prometheus_client takes them."""
    out = [(str(b), c) for b, c in zip(hist.buckets, hist.cumulative)]
    out.append(("+Inf", hist.cumulative[-1]))
    return out


def model_slot_families(snap: PoolStatus):
    """Slots per model and state, from the ledger (bounded by the workers
    registered): the supply side of the demand an autoscaler reads
    (deploy/kubernetes/README.md)."""
    family = GaugeMetricFamily(
        "llamapool_model_slots",
        "Slots in the ledger by model and state (idle, busy, cancelling, "
        "loading, failed)", labels=["model", "state"])
    counts = collections.Counter((s.model, s.state) for s in snap.slots)
    for (model, state), n in sorted(counts.items()):
        family.add_metric([model, state], n)
    yield family


def prompt_cache_families(snap: PoolStatus):
    """The workers' prompt-state caches, summed over the slots in the ledger
    (each from its worker's last CACHE_REPORT). Hits, misses and evictions
    are the workers' own counters: a worker that leaves takes its share
    with it, which Prometheus reads as a counter reset."""
    caches = [s.prompt_cache for s in snap.slots if s.prompt_cache is not None]

    def total(field: str) -> int:
        return sum(getattr(c, field) for c in caches)

    for name, doc, field in (
            ("hits", "Jobs that restored a saved prompt state", "hits"),
            ("misses", "Jobs of a block or more that found no cached prefix",
             "misses"),
            ("evictions", "Prompt states evicted to stay inside --cache-ram",
             "evictions"),
            ("dropped", "Prompt states refused or dropped (larger than the "
             "limit, or failed to restore)", "dropped")):
        yield CounterMetricFamily(f"llamapool_prompt_cache_{name}_total", doc,
                                  value=total(field))
    yield GaugeMetricFamily("llamapool_prompt_cache_bytes",
                            "Bytes of saved prompt states in all workers",
                            value=total("bytes_used"))
    yield GaugeMetricFamily("llamapool_prompt_cache_limit_bytes",
                            "Sum of the workers' --cache-ram limits",
                            value=total("bytes_limit"))
    yield GaugeMetricFamily("llamapool_prompt_cache_states",
                            "Saved prompt states in all workers",
                            value=total("states"))


class LatestSnapshotCollector:
    """Serves the newest snapshot the broker loop published.

    The HTTP server runs in its own thread; reading the ledger from there
    would race the broker loop, so the loop publishes a fresh snapshot each
    heartbeat and this only swaps a reference.
    """

    def __init__(self) -> None:
        self._snapshot: PoolStatus | None = None
        self._published_at: float | None = None
        self._lock = threading.Lock()

    def publish(self, snapshot: PoolStatus) -> None:
        with self._lock:
            self._snapshot = snapshot
            self._published_at = time.monotonic()

    def collect(self):
        with self._lock:
            snapshot, published_at = self._snapshot, self._published_at
        if snapshot is not None:
            yield from PoolCollector(snapshot).collect()
            # This HTTP thread answers even when the loop is wedged; the age
            # of the loop's last publication is what says it still turns
            # (``llamapool probe broker``).
            yield GaugeMetricFamily(
                "llamapool_broker_loop_beat_age_seconds",
                "Seconds since the routing loop last published its ledger",
                value=time.monotonic() - published_at)


def serve_broker_metrics(port: int, host: str = "0.0.0.0") -> LatestSnapshotCollector:
    """Start the broker's own ``/metrics`` endpoint on ``port``."""
    collector = LatestSnapshotCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return collector
