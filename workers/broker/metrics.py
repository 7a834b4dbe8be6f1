"""The broker's ledger and pool totals as Prometheus metric families.

Rendered from a broker snapshot (``Broker.snapshot``), either by a frontend's
``/metrics`` (snapshot fetched over ZeroMQ) or by the broker's own
``--metrics-port`` endpoint.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.payloads import PoolStatus
from workers.broker.counters import BrokerCounters
from workers.broker.key_metrics import key_usage_families
from workers.broker.model_metrics import (
    job_families,
    prompt_cache_families,
    slot_families,
)


class PoolCollector:
    """Renders one broker snapshot as metric families (per scrape)."""

    def __init__(self, snapshot: PoolStatus) -> None:
        self.snapshot = snapshot

    def collect(self):
        # Long, and exempt from the 80-line rule on purpose: one flat list of
        # series, each its name, help and value; split, it would only be
        # harder to find one.
        snap = self.snapshot
        counters = BrokerCounters.from_dict(snap.counters)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        # Each model's own (``workers.broker.model_metrics``: a ``model``
        # label); then the broker's, which are about no one model.
        yield from job_families(snap)
        yield from prompt_cache_families(snap)
        yield from slot_families(snap)
        yield from key_usage_families(snap)
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
