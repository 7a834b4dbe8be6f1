"""Multipart send and receive on the hot paths, without pyzmq's per-call cost.

pyzmq's ``send_multipart`` and ``recv_multipart`` are Python wrappers around
its backend socket. For each part, ``send_multipart`` computes
``zmq.SNDMORE | flags`` on ``IntFlag`` enums (an enum instance built per
frame), checks the buffer, and goes through the sugar ``send``'s routing-id
branches; ``recv_multipart`` asks ``getsockopt(RCVMORE)`` per part. Every
generated token crosses such calls in the worker, the broker and the
frontend, and in the broker they were a fifth of its CPU per relayed frame
(py-spy, BENCHMARKS.md section 13: ~13% enum arithmetic alone).

These two call the backend's ``send`` and ``recv`` (``zmq.backend.Socket``,
the class pyzmq's ``zmq.Socket`` extends) with plain int flags: a 4-part
send measured 1.4 µs against 11 µs, a receive 7 µs against 12 µs. Same
behaviour as the sugar calls with ``zmq.NOBLOCK``: ``zmq.Again`` (or another
``zmq.ZMQError``) when the first part cannot go or nothing is waiting; the
later parts of a message never fail once its first is accepted (libzmq
queues a multipart message whole).
"""

from __future__ import annotations

import zmq

_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send ``frames`` as one message without blocking."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], _MORE)
    _send(sock, frames[last], _NOBLOCK)


def waiting(sock: zmq.Socket) -> bool:
    """Whether a whole message can be received now. A receive that finds
    nothing raises ``zmq.Again``, and building that exception cost more than
    a receive (py-spy: 6% of the broker at two tokens in flight, where each
    poll round finds one message); asking costs a getsockopt."""
    return bool(_get(sock, _EVENTS) & _POLLIN)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """The next whole message's frames, without blocking
    (``zmq.Again`` when none is waiting)."""
    frame = _recv(sock, _NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames
