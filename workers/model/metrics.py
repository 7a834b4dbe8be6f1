"""A model worker's own ``/metrics`` (``llamapool worker --metrics-port``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class WorkerCollector:
    """Reads plain counters the worker keeps; ints are safe to read across
    threads in CPython, so no lock is needed for a scrape."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self):
        w = self.worker
        yield CounterMetricFamily("llamapool_worker_jobs_total",
                                  "Jobs this worker ended", value=w.jobs_done)
        yield CounterMetricFamily("llamapool_worker_tokens_generated_total",
                                  "Tokens this worker generated",
                                  value=w.tokens_generated)
        yield CounterMetricFamily("llamapool_worker_malformed_frames_dropped_total",
                                  "Malformed messages from the broker, dropped",
                                  value=w.malformed_dropped)
        yield CounterMetricFamily("llamapool_worker_unsent_dropped_total",
                                  "Messages to the broker dropped: its "
                                  "connection was gone (the link redials)",
                                  value=w.unsent_dropped)
        yield CounterMetricFamily("llamapool_worker_link_callback_errors_total",
                                  "Exceptions caught in the broker link's "
                                  "callbacks (logged; the link went on)",
                                  value=w.link_callback_errors)
        report = w.cache_report
        if report is not None:
            c = report.status
            yield CounterMetricFamily("llamapool_worker_prompt_cache_hits_total",
                                      "Jobs that restored a saved prompt state",
                                      value=c.hits)
            yield CounterMetricFamily("llamapool_worker_prompt_cache_misses_total",
                                      "Jobs that found no cached prefix",
                                      value=c.misses)
            yield CounterMetricFamily(
                "llamapool_worker_prompt_cache_evictions_total",
                "Prompt states evicted to stay inside --cache-ram",
                value=c.evictions)
            yield GaugeMetricFamily("llamapool_worker_prompt_cache_bytes",
                                    "Bytes of saved prompt states", value=c.bytes_used)
            yield GaugeMetricFamily("llamapool_worker_prompt_cache_states",
                                    "Saved prompt states", value=c.states)
        yield GaugeMetricFamily("llamapool_worker_loaded",
                                "1 once the model has loaded",
                                value=0 if w.engine is None else 1)
        yield GaugeMetricFamily("llamapool_worker_busy", "1 while a job runs",
                                value=1 if w.busy else 0)
        # Readiness and liveness for ``llamapool probe worker``: this HTTP
        # thread answers even when the link thread is stuck, so the beat's
        # age, not the answer, says the link still turns.
        yield GaugeMetricFamily("llamapool_worker_registered",
                                "1 while a broker holds this worker in its ledger",
                                value=1 if w.registered else 0)
        beat_at = w.link_beat_at
        if beat_at is not None:
            yield GaugeMetricFamily(
                "llamapool_worker_link_beat_age_seconds",
                "Seconds since the broker link's thread last beat",
                value=time.monotonic() - beat_at)


def serve_worker_metrics(worker, port: int, host: str = "0.0.0.0") -> None:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    start_http_server(port, addr=host, registry=registry)
