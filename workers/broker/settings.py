"""The broker's settings: one frozen object from flags and ``LLAMAPOOL_*``.

A flag given to ``llamapool broker`` wins over its variable, which wins over
the default (``protocol.settings.load``). Every default is documented here:

| variable                             | default    | meaning                          |
|--------------------------------------|------------|----------------------------------|
| LLAMAPOOL_FRONTENDS_ENDPOINT         | (required) | bind for frontends (--frontends) |
| LLAMAPOOL_WORKERS_ENDPOINT           | (required) | bind for workers (--workers)     |
| LLAMAPOOL_HEARTBEAT_INTERVAL_S       | 1.0        | heartbeat to every peer          |
| LLAMAPOOL_HEARTBEAT_LIVENESS         | 3          | missed beats = peer dead         |
| LLAMAPOOL_CURVE_SECRET_KEY           | (none)     | own .key_secret (enables CURVE)  |
| LLAMAPOOL_CURVE_AUTHORIZED_WORKERS   | (none)     | worker .key files allowed in     |
| LLAMAPOOL_CURVE_AUTHORIZED_FRONTENDS | (none)     | frontend .key files allowed in   |
| LLAMAPOOL_INSECURE_PLAINTEXT         | 0          | allow non-loopback w/o CURVE     |
| LLAMAPOOL_BROKER_METRICS_PORT        | 0          | port for own /metrics (0: off)   |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from protocol import timing
from protocol.settings import ConfigError, setting


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
    #: One directory per role: a key may act only as what its directory says.
    curve_authorized_workers: str = setting(
        "", "LLAMAPOOL_CURVE_AUTHORIZED_WORKERS", "worker .key files allowed in")
    curve_authorized_frontends: str = setting(
        "", "LLAMAPOOL_CURVE_AUTHORIZED_FRONTENDS",
        "frontend .key files allowed in")
    insecure_plaintext: bool = setting(
        False, "LLAMAPOOL_INSECURE_PLAINTEXT",
        "allow non-loopback w/o CURVE")
    metrics_port: int = setting(
        0, "LLAMAPOOL_BROKER_METRICS_PORT", "port for own /metrics (0: off)")


#: The single role-less directory of earlier versions. It authorised every
#: key on both sockets, so it is refused with directions, not reinterpreted.
REMOVED_AUTHORIZED_DIR = (
    "--curve-authorized-dir / LLAMAPOOL_CURVE_AUTHORIZED_DIR is gone: CURVE keys "
    "now have roles. Put the workers' public keys in one directory and the "
    "frontends' in another, and pass --curve-authorized-workers DIR and "
    "--curve-authorized-frontends DIR (LLAMAPOOL_CURVE_AUTHORIZED_WORKERS, "
    "LLAMAPOOL_CURVE_AUTHORIZED_FRONTENDS). Running `llamapool keygen` on the "
    "old key directory lays them out as authorized/workers and "
    "authorized/frontends; see deploy/README.md, \"Upgrading\"."
)


def reject_removed(env: Mapping[str, str], authorized_dir_flag: str | None) -> None:
    """Refuse the removed single directory, as a flag or a variable.

    Raises:
        ConfigError: it is set; the message says what to do instead.
    """
    if authorized_dir_flag or env.get("LLAMAPOOL_CURVE_AUTHORIZED_DIR", ""):
        raise ConfigError(REMOVED_AUTHORIZED_DIR)
