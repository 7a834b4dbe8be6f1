"""Whether the client of a request has already gone, before work is spent.

A request that waits at the door (a grammar's check, the prompt gate's
tokenizing, a busy gunicorn thread) can outlive its client, and the work it
would then start (a slot, a SUBMIT to a worker) serves nobody. gunicorn
hands the connection's socket in the WSGI environ: a peer that closed or
reset it is readable with nothing to read (or flags a hang-up). Under
anything else (in-process tests, a Unix socket behind a proxy that keeps
the connection) nothing can be told, and the request goes on.
"""

from __future__ import annotations

import select
import socket

import falcon

_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


def client_gone(req: falcon.Request) -> bool:
    """True if the request's connection is closed or reset by its peer.

    Bytes waiting on the socket (a pipelined next request) mean it is still
    there; only an end of stream or an error says it has gone.
    """
    sock = req.env.get("gunicorn.socket")
    if not isinstance(sock, socket.socket):
        return False
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN | _HUNG_UP)
        events = poller.poll(0)
    except (OSError, ValueError):
        return True  # closed under us
    if not events:
        return False
    flags = events[0][1]
    if flags & (select.POLLHUP | select.POLLERR):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset
