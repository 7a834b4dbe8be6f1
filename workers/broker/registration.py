"""Workers joining the ledger: LOADING, READY, the pool's size cap, and which
registrations are restarts (``llamapool_worker_restarts_total``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import messages
from protocol.errors import ErrorCode
from workers.broker.restarts import HostDeaths

if TYPE_CHECKING:
    from workers.broker.broker import Broker


class WorkerRegistration:
    """Admits workers (at most ``max_workers``) and counts restarts."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        # Deaths per host not yet followed by a new registration from that
        # host: the next READY from it counts as a restart.
        self._deaths_by_host = HostDeaths(broker.settings.max_workers)

    def on_worker_gone(self, host: str) -> None:
        self._deaths_by_host.died(host)

    def on_loading(self, ident: bytes, msg: messages.Loading, now: float) -> None:
        b = self._broker
        if self._pool_full(ident, msg) or self._names_clash(ident, msg):
            return
        if ident not in b.ledger.workers:
            b.log.info("worker loading",
                       "worker loading: name=%s pid=%d host=%s model=%s",
                       msg.worker_name, msg.pid, msg.host, msg.model)
        b.ledger.register_loading(ident, msg, now)

    def on_ready(self, ident: bytes, msg: messages.Ready, now: float) -> None:
        b = self._broker
        if self._pool_full(ident, msg) or self._names_clash(ident, msg):
            return
        b.counters.worker_registrations += 1
        if self._deaths_by_host.registered(msg.host):
            b.counters.worker_restarts += 1
            b.log.info("worker restarted", "worker restarted on host %s (pid %d)",
                       msg.host, msg.pid)
        slot, orphan = b.ledger.register_worker(ident, msg, now)
        # Acknowledge at once: the worker ignores DISCONNECTs until it hears
        # from us after READY (they answer older messages).
        b.to_worker(ident, messages.Heartbeat())
        if orphan is not None:
            b.stats.job_lost(orphan.model)
            b.fail_job(orphan, ErrorCode.WORKER_RESTARTED, "worker re-registered")
        b.log.info(
            "worker registered",
            "worker registered: slot=%d name=%s pid=%d host=%s model=%s "
            "aliases=%s capabilities=%s", slot.slot_id, msg.worker_name, msg.pid,
            msg.host, msg.model, ",".join(msg.aliases) or "-",
            ",".join(msg.capabilities) or "-",
        )

    def _pool_full(self, ident: bytes, msg: messages.Loading | messages.Ready
                   ) -> bool:
        """Refuse a new worker beyond ``max_workers`` (True if refused)."""
        b = self._broker
        if (ident in b.ledger.workers
                or len(b.ledger.workers) < b.settings.max_workers):
            return False
        b.counters.worker_refused_full += 1
        b.log.warning(
            "worker refused", "worker refused: the pool is full (%d workers, "
            "--max-workers): name=%s pid=%d host=%s",
            len(b.ledger.workers), msg.worker_name, msg.pid, msg.host)
        b.to_worker(ident, messages.Disconnect("the pool is full"))
        return True

    def _names_clash(self, ident: bytes, msg: messages.Loading | messages.Ready
                     ) -> bool:
        """Refuse a worker whose model name or aliases would make one name
        mean two models (``model_index.ModelIndex.conflict``): True if
        refused. It is told why, and keeps asking (as a worker refused for
        a full pool does) until the operator renames one of them."""
        b = self._broker
        why = b.ledger.models.conflict(ident, msg.model, msg.aliases)
        if not why:
            return False
        b.counters.worker_refused_model += 1
        b.log.warning("worker refused model", "worker refused: %s: name=%s "
                      "pid=%d host=%s", why, msg.worker_name, msg.pid, msg.host)
        b.to_worker(ident, messages.Disconnect(why))
        return True
