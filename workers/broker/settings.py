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
| LLAMAPOOL_MAX_WORKERS                | 1024       | more registrations are refused   |
| LLAMAPOOL_FIRST_FRAME_TIMEOUT_S      | 30.0       | job fails if its worker is mute  |
| LLAMAPOOL_CANCEL_TIMEOUT_S           | 30.0       | stuck cancel: worker dropped     |
| LLAMAPOOL_STEP_DOWN_WAIT_S           | 0.25       | SUBMIT waits for step-downs      |
| LLAMAPOOL_QUEUE_MAX                  | 0          | jobs that may wait (0: 503 now)  |
| LLAMAPOOL_QUEUE_MAX_TOKENS           | 0          | their prompt tokens (0: any)     |
| LLAMAPOOL_QUEUE_TIMEOUT_S            | 30.0       | longest wait, then 503           |
| LLAMAPOOL_QUEUE_ORDER                | fair       | fair (by key) or fifo            |
| LLAMAPOOL_ROUTING                    | prefix     | prefix or lru (see below)        |

``routing``: ``prefix`` gives a job to the idle worker that holds the most of
its prompt's prefix blocks, live or in its prompt-state cache (each worker
reports them, ``protocol.prompt_cache``), the least recently used one among
equals; ``lru`` ignores prefixes (the least recently used idle worker), to
measure what prefix routing gains. Either way a job never waits for a busy
worker that holds its prefix: it goes to another idle one, or gets NO_SLOT.

``queue_max``: with 0 (the default) a job that finds every slot busy gets
NO_SLOT at once, the 503 the seed asks for. Above 0, up to that many jobs
wait for a slot, and with them at most ``queue_max_tokens`` prompt tokens
(0: no bound), each at most ``queue_timeout_s`` (or less, as its request
asks); a job beyond a bound, or past its deadline, gets NO_SLOT with a
Retry-After that counts the queue ahead. A freed slot goes to the key that
had the least service lately, and among that key's jobs to the one whose
prompt the slot's worker holds best (``workers.broker.waiting_room``).

``max_workers`` bounds the ledger (and with it every STATUS reply and the
per-host restart table): a flood of fake registrations beyond it gets
DISCONNECT and is counted, never routed to. It may be at most 10 000, what a
STATUS reply can carry (``protocol.limits``).

``first_frame_timeout_s``: a worker that was given a job must show it has it
within this time, by a job frame (TOKEN, FINAL, ERROR) or by a heartbeat
whose progress names the job. A real worker's link thread heartbeats every
interval also while its engine prefills a long prompt (ctypes releases the
GIL), so it shows the job within about one heartbeat interval however slow
the prefill; 30 s is thirty of those. A worker that stays silent on the job
loses it (its frontend gets ERROR ``worker_unresponsive``, not a hang) and is
dropped from the ledger with DISCONNECT.

``cancel_timeout_s``: a job its frontend cancelled (or whose frontend is
gone) must end within this time. A real worker ends a cancelled job at its
next token, so a worker still ``cancelling`` after it is stuck in native
code (issue 29: one grammar-bound token took minutes): it is dropped from
the ledger with DISCONNECT, its slot no longer counted until it registers
again, and the worker, which keeps the same deadline
(``LLAMAPOOL_CANCEL_TIMEOUT_S`` is read by both), ends its own process so
that ``llamapool up`` or systemd starts a fresh one. 30 s is thirty
heartbeats: far above a token's time on any model the pool runs, and above
the prefill of a full 2048-token context at 100 tokens/s, the one stretch
that llama.cpp runs with no cancel check (raise it for long contexts on
slow CPUs: a worker cancelled mid-prefill past it is restarted, which costs
its reload and its RAM prompt cache, not a client's answer).

``step_down_wait_s``: with ``--threads auto`` workers, a new job's SUBMIT
waits until the running workers on its host confirm they use fewer threads,
at most this long (``workers.broker.step_down``). 0 sends it at once, as
fixed ``--threads`` pools do (for comparison: ``make bench-thread-stepdown``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from protocol import limits, timing
from protocol.settings import (
    ConfigError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    setting,
)

#: The most workers one STATUS reply can describe (``protocol.limits``).
MAX_WORKERS_LIMIT = 10_000

#: ``--routing``: how the broker picks among idle workers (``workers.broker.ledger``).
ROUTING_POLICIES = ("prefix", "lru")
#: Who gets a freed slot (``waiting_room``): the key served least lately,
#: or the oldest waiter (for comparison: ``make bench-overload``).
QUEUE_ORDERS = ("fair", "fifo")
assert MAX_WORKERS_LIMIT * limits.MAX_SLOT_STATUS_BYTES <= (
    limits.MAX_STATUS_REPLY_BYTES)


@dataclasses.dataclass(frozen=True)
class BrokerSettings:
    frontends_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_FRONTENDS_ENDPOINT",
        "bind for frontends (--frontends)",
        flag="--frontends")
    workers_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_WORKERS_ENDPOINT",
        "bind for workers (--workers)",
        flag="--workers")
    heartbeat_interval_s: float = setting(
        timing.HEARTBEAT_INTERVAL_S, "LLAMAPOOL_HEARTBEAT_INTERVAL_S",
        "heartbeat to every peer",
        flag="--heartbeat-interval-s", parse=positive_float)
    heartbeat_liveness: int = setting(
        timing.HEARTBEAT_LIVENESS, "LLAMAPOOL_HEARTBEAT_LIVENESS",
        "missed beats = peer dead",
        flag="--heartbeat-liveness", parse=positive_int)
    #: CURVE (see ``workers.broker.security``); empty paths mean plaintext.
    curve_secret_key: str = setting(
        "", "LLAMAPOOL_CURVE_SECRET_KEY", "own .key_secret (enables CURVE)",
        flag="--curve-secret-key")
    #: One directory per role: a key may act only as what its directory says.
    curve_authorized_workers: str = setting(
        "", "LLAMAPOOL_CURVE_AUTHORIZED_WORKERS", "worker .key files allowed in",
        flag="--curve-authorized-workers")
    curve_authorized_frontends: str = setting(
        "", "LLAMAPOOL_CURVE_AUTHORIZED_FRONTENDS",
        "frontend .key files allowed in",
        flag="--curve-authorized-frontends")
    insecure_plaintext: bool = setting(
        False, "LLAMAPOOL_INSECURE_PLAINTEXT",
        "allow non-loopback w/o CURVE",
        flag="--insecure-plaintext", const=True)
    metrics_port: int = setting(
        0, "LLAMAPOOL_BROKER_METRICS_PORT", "port for own /metrics (0: off)",
        flag="--metrics-port", parse=non_negative_int)
    max_workers: int = setting(
        1024, "LLAMAPOOL_MAX_WORKERS", "more registrations are refused",
        flag="--max-workers", parse=positive_int)
    first_frame_timeout_s: float = setting(
        30.0, "LLAMAPOOL_FIRST_FRAME_TIMEOUT_S", "job fails if its worker is mute",
        flag="--first-frame-timeout-s", parse=positive_float)
    cancel_timeout_s: float = setting(
        timing.CANCEL_TIMEOUT_S, "LLAMAPOOL_CANCEL_TIMEOUT_S",
        "stuck cancel: worker dropped",
        flag="--cancel-timeout-s", parse=positive_float)
    step_down_wait_s: float = setting(
        0.25, "LLAMAPOOL_STEP_DOWN_WAIT_S", "SUBMIT waits for step-downs",
        flag="--step-down-wait-s", parse=non_negative_float)
    queue_max: int = setting(
        0, "LLAMAPOOL_QUEUE_MAX", "jobs that may wait (0: 503 now)",
        flag="--queue-max", parse=non_negative_int)
    queue_max_tokens: int = setting(
        0, "LLAMAPOOL_QUEUE_MAX_TOKENS", "their prompt tokens (0: any)",
        flag="--queue-max-tokens", parse=non_negative_int)
    queue_timeout_s: float = setting(
        30.0, "LLAMAPOOL_QUEUE_TIMEOUT_S", "longest wait, then 503",
        flag="--queue-timeout-s", parse=positive_float)
    queue_order: str = setting(
        "fair", "LLAMAPOOL_QUEUE_ORDER", "fair (by key) or fifo",
        flag="--queue-order", choices=QUEUE_ORDERS)
    routing: str = setting(
        "prefix", "LLAMAPOOL_ROUTING", "prefix or lru (see below)",
        flag="--routing", choices=ROUTING_POLICIES)

    def __post_init__(self) -> None:
        if not 1 <= self.max_workers <= MAX_WORKERS_LIMIT:
            raise ConfigError(f"LLAMAPOOL_MAX_WORKERS={self.max_workers} must be "
                              f"between 1 and {MAX_WORKERS_LIMIT}")
        if self.queue_order not in QUEUE_ORDERS:
            raise ConfigError(f"LLAMAPOOL_QUEUE_ORDER={self.queue_order!r} must be "
                              f"one of {', '.join(QUEUE_ORDERS)}")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"LLAMAPOOL_ROUTING={self.routing!r} must be one of "
                              f"{', '.join(ROUTING_POLICIES)}")
        if not self.first_frame_timeout_s > 0:
            raise ConfigError("LLAMAPOOL_FIRST_FRAME_TIMEOUT_S must be positive")
        if not 0 <= self.step_down_wait_s <= 10:
            raise ConfigError("LLAMAPOOL_STEP_DOWN_WAIT_S must be from 0 to 10")


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
