"""The broker's two ROUTER sockets: one for frontends, one for workers.

Both set ``ROUTER_MANDATORY``, so that a send to a gone peer raises instead
of vanishing, and a send to a full pipe raises EAGAIN instead of blocking the
loop or dropping a frame silently (``SNDHWM``). What one peer can park in
the broker is at most ``SNDHWM`` messages out and ``RCVHWM`` frames in, each
at most the size limit of its kind (``protocol.limits``), and libzmq drops a
peer that sends a frame over ``MAXMSGSIZE`` before buffering it.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from protocol import curve, limits
from protocol.zmq_frames import send_frames
from workers.broker.counters import BrokerCounters
from workers.broker.security import BrokerSecurity
from workers.broker.settings import BrokerSettings

#: Messages queued per peer towards it. A live peer reads at once; this is
#: room for bursts (a frontend streaming many jobs' TOKEN frames while its
#: process is descheduled), not a buffer anyone should fill.
SNDHWM = 10_000
#: Frames queued per peer towards us. Small: a peer that sends faster than
#: we read waits (back-pressure: its own DEALER keeps the rest, nothing is
#: dropped), and a flood of maximal frames parks at most this many of them
#: here (32 x 2 MiB). The price: a peer that closes its socket with a short
#: linger right after a burst may lose the tail of the burst.
RCVHWM = 32


class PeerSockets:
    """Binds, sends (never raising, never blocking) and closes."""

    def __init__(self, settings: BrokerSettings, ctx: zmq.Context,
                 security: BrokerSecurity, counters: BrokerCounters, *,
                 on_stuck_frontend: Callable[[bytes], None]) -> None:
        self._settings = settings
        self._ctx = ctx
        self._security = security
        self._counters = counters
        #: A frontend whose pipe is full (it does not read): the broker drops
        #: it after the current message (``expiry.StuckFrontends``).
        self._on_stuck_frontend = on_stuck_frontend
        self.frontends: zmq.Socket | None = None
        self.workers: zmq.Socket | None = None

    def _router(self, endpoint: str, role: str, max_frame_bytes: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # libzmq drops the connection of a peer that sends a larger frame,
        # before buffering it (the body frame is the large one).
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        self._security.configure(sock, role)
        sock.bind(endpoint)
        return sock

    def bind(self) -> None:
        settings = self._settings
        self._security.check_endpoints(
            (settings.frontends_endpoint, settings.workers_endpoint))
        self._security.start(self._ctx)
        self.frontends = self._router(settings.frontends_endpoint, curve.FRONTENDS,
                                      limits.MAX_FRAME_FROM_FRONTEND)
        self.workers = self._router(settings.workers_endpoint, curve.WORKERS,
                                    limits.MAX_FRAME_FROM_WORKER)

    def close(self) -> None:
        for sock in (self.frontends, self.workers):
            if sock is not None:
                sock.close(linger=0)
        self._security.stop()

    def send(self, sock: zmq.Socket, identity: bytes, msg_or_frames) -> bool:
        """Send a message, or frames as they came, to one peer; False if the
        peer is gone or its pipe is full."""
        frames = (msg_or_frames if isinstance(msg_or_frames, list)
                  else msg_or_frames.to_wire())
        try:
            # Never blocking: with ROUTER_MANDATORY a full pipe would otherwise
            # block the whole loop until the peer reads.
            send_frames(sock, [identity, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._counters.send_unroutable += 1
                if exc.errno == zmq.EAGAIN and sock is self.frontends:
                    self._on_stuck_frontend(identity)
                return False
            raise
