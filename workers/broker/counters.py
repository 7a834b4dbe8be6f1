"""The broker's event counters: one typed object, shared with its metrics.

Each counter is a field, so a misspelt name is an ``AttributeError`` where
it is counted or read, not a series that reads zero forever. They travel in
STATUS as the flat ``{name: count}`` map they always did
(``PoolStatus.counters``, which tests, the frontend's merged view and
``/metrics`` read); failed jobs are counted per error code there as
``failed_<code>``.
"""

from __future__ import annotations

import collections
import dataclasses

from protocol.errors import ErrorCode


@dataclasses.dataclass
class BrokerCounters:
    """Every count the broker keeps (``PoolStatus.counters`` on the wire)."""

    # Jobs.
    submitted: int = 0
    no_slot: int = 0
    #: SUBMITs for a model no worker of this broker serves, or only loads.
    model_not_found: int = 0
    model_loading: int = 0
    #: Jobs that waited for a slot (``--queue-max``), and how waits ended
    #: other than with a slot: the queue full, the deadline, the client gone.
    queued: int = 0
    queue_full: int = 0
    queue_expired: int = 0
    queue_left: int = 0
    finished: int = 0
    routed_by_prefix: int = 0
    tokens_relayed: int = 0
    stale_frames: int = 0
    submits_held_for_step_down: int = 0
    step_down_waits_expired: int = 0
    status_requests: int = 0
    #: SUBMITs from frontends that did not decode but named their job,
    #: answered with ERROR ``unreadable_job``.
    unreadable_submits: int = 0
    #: Cache claims checked against the FINAL's ``cached_tokens``
    #: (``workers.broker.cache_claims``), and workers whose claims stopped
    #: steering routing.
    cache_claims_kept: int = 0
    cache_claims_failed: int = 0
    workers_distrusted: int = 0
    # Workers.
    worker_registrations: int = 0
    worker_restarts: int = 0
    worker_deaths: int = 0
    worker_refused_full: int = 0
    #: Workers refused because their model's name or an alias would name
    #: two models, or the broker holds ``limits.MAX_MODELS`` already.
    worker_refused_model: int = 0
    worker_unresponsive: int = 0
    worker_protocol_errors: int = 0
    #: Workers dropped for not ending a cancelled job within
    #: ``--cancel-timeout-s`` (stuck in native code).
    worker_cancel_timeouts: int = 0
    # Frontends.
    frontend_deaths: int = 0
    frontend_send_full: int = 0
    # Any peer.
    malformed_dropped: int = 0
    unknown_peer: int = 0
    protocol_violation: int = 0
    send_unroutable: int = 0
    drain_budget_spent: int = 0
    # CURVE (``workers.broker.security``; the ZAP thread counts refusals).
    curve_refused: int = 0
    curve_refused_workers: int = 0
    curve_refused_frontends: int = 0
    curve_revoked_dropped: int = 0
    curve_revoked_peers: int = 0
    #: Jobs the broker failed, by error code.
    failed: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)

    def job_failed(self, code: ErrorCode) -> None:
        self.failed[str(code)] += 1

    def curve_refusal(self, role: str) -> None:
        """A refused handshake of a peer of ``role`` (workers or frontends)."""
        self.curve_refused += 1
        name = f"curve_refused_{role}"
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        """The wire form: every counter, and ``failed_<code>`` per code."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "failed"}
        flat.update({f"failed_{code}": n for code, n in self.failed.items()})
        return flat

    @classmethod
    def from_dict(cls, counts: dict[str, int]) -> BrokerCounters:
        """Read a STATUS reply's counters back (a missing one is 0: a broker
        of an older version; an unknown one is ignored: a newer one)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"failed"}
        counters = cls(**{k: v for k, v in counts.items() if k in names})
        counters.failed.update({k[len("failed_"):]: v for k, v in counts.items()
                                if k.startswith("failed_")})
        return counters
