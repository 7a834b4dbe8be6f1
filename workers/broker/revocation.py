"""CURVE keys revoked after their handshake: checked on every message.

ZAP checks a peer's key once, at the handshake (``workers.broker.security``);
the key may be removed or overwritten since. libzmq stamps every message
with the key ZAP accepted (its ``User-Id`` property), so the check per
message is a set lookup against each role's authorized keys, which are
re-read once per heartbeat. A peer whose key is gone leaves the ledger (a
worker's job fails, a frontend's jobs are cancelled) and hears nothing more
from us: its link redials after its silence window, and ZAP refuses the new
handshake.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

from protocol import curve

if TYPE_CHECKING:
    from workers.broker.broker import Broker

log = logging.getLogger("llamapool.broker")


class KeyRevocation:
    """Each message's CURVE key against the keys authorized now."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        #: Each role's authorized keys; None in plaintext (nothing to check).
        self.allowed: dict[str, frozenset[bytes]] | None = None

    def on_beat(self, now: float) -> None:
        if self.allowed is not None:
            self.refresh()

    def refresh(self) -> None:
        self.allowed = self._broker.security.current_keys()

    def recv(self, sock: zmq.Socket, role: str) -> list[bytes] | None:
        """One message, or None if its sender's key is no longer authorized.
        Raises ``zmq.Again`` when nothing is waiting."""
        first = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        if first.more:
            frames += sock.recv_multipart()
        try:
            key = first.get("User-Id").encode()
        except zmq.ZMQError:
            key = b""  # no key on record: not one we authorized
        if key in self.allowed[role]:
            return frames
        self._revoked(role, frames[0], key)
        return None

    def _revoked(self, role: str, ident: bytes, key: bytes) -> None:
        b = self._broker
        b.counters.curve_revoked_dropped += 1
        if role == curve.WORKERS and ident in b.ledger.workers:
            b.counters.curve_revoked_peers += 1
            log.warning("CURVE key %s revoked: dropping its worker",
                        key.decode(errors="replace"))
            b.worker_died(ident, "CURVE key revoked")
        elif role == curve.FRONTENDS and ident in b.ledger.frontends:
            b.counters.curve_revoked_peers += 1
            log.warning("CURVE key %s revoked: dropping its frontend",
                        key.decode(errors="replace"))
            b.frontend_gone(ident, time.monotonic())
