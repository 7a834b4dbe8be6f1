"""A worker that says goodbye and closes its socket is not counted dead.

The worker sends DISCONNECT and closes its socket. The broker's heartbeat
pass can then find the worker's pipe gone before the loop has read the
DISCONNECT already queued on that socket (both happen in one loop round).
It used to count that worker as lost ("unreachable"), a death for
``worker_deaths``. It was seen once in CI, in ``tests/test_shutdown.py``.

The real ``Broker`` runs in process here, so the test can run the heartbeat
pass at the point where the race happens: after the worker's connection has
closed, before the loop reads the goodbye.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import messages
from tests.pool import wait_until
from workers.broker.broker import Broker
from workers.broker.settings import BrokerSettings

DEADLINE_S = 30.0


def test_a_goodbye_queued_behind_a_closed_connection_is_not_a_death(tmp_path):
    ctx = zmq.Context()
    broker = Broker(BrokerSettings(frontends_endpoint=f"ipc://{tmp_path}/fe",
                                   workers_endpoint=f"ipc://{tmp_path}/wk"),
                    ctx=ctx)
    broker.bind()
    closed = broker.sockets.workers.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    worker = ctx.socket(zmq.DEALER)
    worker.connect(f"ipc://{tmp_path}/wk")
    try:
        worker.send_multipart(messages.Ready("w", "m", 512, 1, "h").to_wire())

        def registered():
            broker._read_workers()
            return broker.ledger.workers
        wait_until(registered, DEADLINE_S, "the worker to register")
        worker.send_multipart(messages.Disconnect("stopping").to_wire())
        worker.close(linger=int(DEADLINE_S * 1000))  # the goodbye leaves first
        assert closed.poll(DEADLINE_S * 1000), "the broker never saw the close"
        assert recv_monitor_message(closed)["event"] == zmq.EVENT_DISCONNECTED

        # The monitor's event comes from ZeroMQ's I/O thread; the broker's
        # socket takes note of the closed pipe a moment later, when it next
        # processes commands. Wait until it refuses to route to the worker,
        # as the heartbeat pass will find it; the goodbye is still unread.
        (ident,) = broker.ledger.workers
        wait_until(lambda: not broker.to_worker(ident, messages.Heartbeat()),
                   DEADLINE_S, "the broker's socket to drop the closed pipe")
        assert broker.sockets.workers.get(zmq.EVENTS) & zmq.POLLIN
        broker._heartbeat_and_expire(time.monotonic())

        assert not broker.ledger.workers
        assert broker.counters.worker_deaths == 0
    finally:
        closed.close(0)
        broker.close()
        ctx.term()
