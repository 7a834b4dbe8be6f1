"""Prometheus metrics of the frontend, and the pool-wide ones from the broker.

Two sources, one exposition (``GET /metrics``):

* this frontend host's own metrics, defined at module level below. Under
  gunicorn they run in multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` is set
  by ``llamapool frontend`` before Python starts, wiped in gunicorn's
  ``on_starting`` and cleaned per dead worker in ``child_exit``
  (``deploy/gunicorn.conf.py``);
* the pool-wide ``llama_*`` series (named as llama.cpp's server names them),
  llama.cpp's current ``llamacpp:*`` series (``workers.broker.llamacpp_metrics``)
  and slot gauges, rendered on each scrape from the broker's ledger, which
  sees every job of every frontend. Scrape them from one frontend, or
  aggregate with ``max``: every frontend reports the same pool totals.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from protocol.payloads import PoolStatus
from workers.broker.llamacpp_metrics import render as render_llamacpp
from workers.broker.metrics import PoolCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32,
                       0.64, 1.28, 2.56)

REQUESTS_REJECTED = Counter(
    "llamapool_requests_rejected_total",
    "Requests refused before generation, by reason",
    ["reason"],
)
#: The ``model`` label of the series about a request's job: the model the
#: request resolved to in the pool's catalog (``frontend.model_resolution``),
#: never a name as the request gave it, which would let clients mint series
#: without bound. A request resolved with no catalog (no broker answered)
#: or in a pool with no worker yet is labelled ``model=""``.
#:
#: The demand an autoscaler reads (deploy/kubernetes/README.md): client
#: requests answered 503 because no broker had a free slot of their model,
#: once each however many brokers were asked. The series of this
#: frontend's ``LLAMAPOOL_MODEL_NAME`` exists from the start at 0.
REQUESTS_REFUSED_NO_SLOT = Counter(
    "llamapool_requests_refused_no_slot_total",
    "Client requests refused with 503 because no slot was free, by model",
    ["model"],
)
HTTP_RESPONSES = Counter(
    "llamapool_http_responses_total", "HTTP responses by endpoint and status",
    ["endpoint", "status"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "llamapool_time_to_first_token_seconds",
    "From request arrival to the first output frame, by model", ["model"],
    buckets=LATENCY_BUCKETS_S,
)
INTER_TOKEN_LATENCY = Histogram(
    "llamapool_inter_token_latency_seconds",
    "Gap between consecutive output frames, by model", ["model"],
    buckets=TOKEN_GAP_BUCKETS_S,
)
REQUEST_DURATION = Histogram(
    "llamapool_request_duration_seconds",
    "End-to-end time of generation requests, by model", ["model"],
    buckets=LATENCY_BUCKETS_S,
)
SLOT_HOLD = Histogram(
    "llamapool_slot_hold_seconds",
    "How long the frontend held a slot lease, by model", ["model"],
    buckets=LATENCY_BUCKETS_S,
)
LEASE_ENDINGS = Counter(
    "llamapool_lease_endings_total", "How slot leases ended, by model",
    ["model", "ending"],
)
STREAMS_OPEN = Gauge(
    "llamapool_streams_open", "Leases currently held by this frontend host, "
    "by model", ["model"], multiprocess_mode="livesum",
)
FRONTEND_MALFORMED = Counter(
    "llamapool_frontend_malformed_frames_dropped_total",
    "Malformed ZeroMQ messages this frontend dropped",
)


class _DefaultRegistryView:
    """This process's metrics when not under gunicorn (tests, one process)."""

    def collect(self):
        yield from REGISTRY.collect()


def render(snapshot: PoolStatus | None) -> bytes:
    """The text exposition for one scrape (registry built per call)."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_DefaultRegistryView())
    if snapshot is not None:
        registry.register(PoolCollector(snapshot))
        # llama.cpp's own series too, under their exact names.
        return generate_latest(registry) + render_llamacpp(snapshot)
    return generate_latest(registry)
