"""The broker's settings: one frozen object from flags and ``LLAMAPOOL_*``.

A flag given to ``llamapool broker`` wins over its variable, which wins over
the default (``protocol.settings.load``). Every default is documented here:

| variable                       | default    | meaning                          |
|--------------------------------|------------|----------------------------------|
| LLAMAPOOL_FRONTENDS_ENDPOINT   | (required) | bind for frontends (--frontends) |
| LLAMAPOOL_WORKERS_ENDPOINT     | (required) | bind for workers (--workers)     |
| LLAMAPOOL_HEARTBEAT_INTERVAL_S | 1.0        | heartbeat to every peer          |
| LLAMAPOOL_HEARTBEAT_LIVENESS   | 3          | missed beats = peer dead         |
| LLAMAPOOL_CURVE_SECRET_KEY     | (none)     | own .key_secret (enables CURVE)  |
| LLAMAPOOL_CURVE_AUTHORIZED_DIR | (none)     | public .key files allowed in     |
| LLAMAPOOL_INSECURE_PLAINTEXT   | 0          | allow non-loopback w/o CURVE     |
| LLAMAPOOL_BROKER_METRICS_PORT  | 0          | port for own /metrics (0: off)   |
"""

from __future__ import annotations

import dataclasses

from protocol import timing
from protocol.settings import setting


@dataclasses.dataclass(frozen=True)
class BrokerSettings:
    frontends_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_FRONTENDS_ENDPOINT",
        "bind for frontends (--frontends)")
    workers_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_WORKERS_ENDPOINT",
        "bind for workers (--workers)")
    heartbeat_interval_s: float = setting(
        timing.HEARTBEAT_INTERVAL_S, "LLAMAPOOL_HEARTBEAT_INTERVAL_S",
        "heartbeat to every peer")
    heartbeat_liveness: int = setting(
        timing.HEARTBEAT_LIVENESS, "LLAMAPOOL_HEARTBEAT_LIVENESS",
        "missed beats = peer dead")
    #: CURVE (see ``workers.broker.security``); empty paths mean plaintext.
    curve_secret_key: str = setting(
        "", "LLAMAPOOL_CURVE_SECRET_KEY", "own .key_secret (enables CURVE)")
    curve_authorized_dir: str = setting(
        "", "LLAMAPOOL_CURVE_AUTHORIZED_DIR", "public .key files allowed in")
    insecure_plaintext: bool = setting(
        False, "LLAMAPOOL_INSECURE_PLAINTEXT",
        "allow non-loopback w/o CURVE")
    metrics_port: int = setting(
        0, "LLAMAPOOL_BROKER_METRICS_PORT", "port for own /metrics (0: off)")
