"""A peer's connection to the broker: one DEALER, owned by one thread.

Frontends and model workers reach the broker the same way, and differ only in
what they say. So, as zguide keeps ``mdcliapi``/``mdwrkapi`` apart from the
applications that use them, ``BrokerConnection`` owns the *how* (socket,
heartbeats, silence, reconnect, decode) and a ``LinkHandler`` supplies the
*what*, through callbacks in the style of ``asyncio.Protocol``.

Threads. ZeroMQ sockets are not thread-safe, and sharing one behind a lock is
the pattern zguide warns against, so the link's thread is the only user of
its DEALER. Other threads hand messages over with ``send``: a FIFO plus an
eventfd that the thread's poller watches next to the DEALER. The eventfd is
written only when the link thread may be asleep, so a burst of frames costs
one wake-up, not one system call each. One FIFO keeps each sending thread's
messages in order (a job's TOKEN frames before its FINAL). Handler callbacks
run in the link thread; a ``send`` from there goes straight to the socket.

Liveness (zguide PPP, MDP). The link heartbeats every interval with whatever
the handler's ``heartbeat`` says (a worker's carries LOADING or job
progress). Any frame from the broker counts as a heartbeat. After interval ×
liveness without one the broker is taken for gone: the handler hears
``on_lost``, the DEALER is replaced by a new one (a fresh connection, so no
stale frame queued for the dead broker is delivered to its successor), and
the handler hears ``on_connect`` and registers again.

Decode at the edge: a malformed frame is logged, counted and dropped; nothing
from the network raises through the loop.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import weakref

import zmq

from protocol import limits, messages
from protocol.curve import ClientKeys
from protocol.zmq_frames import recv_frames, send_frames, waiting

log = logging.getLogger("llamapool.link")


#: A new connection that hears nothing gets twice the last one's silence
#: window, up to this many times the normal window.
MAX_BACKOFF = 8

#: libzmq's millisecond options are C ints: a longer silence window (a link
#: that is never to be taken for gone) is clamped, not an error that ends
#: the link thread before it connects.
INT_MAX = 2**31 - 1


class LinkHandler:
    """What an application hears from its ``BrokerConnection``, and says to it.

    Every method is called in the link's thread, which must not block in
    them: heartbeats and the broker's frames wait meanwhile. The defaults do
    nothing; subclasses override what they need.
    """

    def on_connect(self) -> None:
        """A new DEALER is connecting (at start and after every loss):
        the place to register (HELLO)."""

    def on_message(self, msg: messages.Message) -> None:
        """A well-formed message from the broker."""

    def on_lost(self, silent_s: float) -> None:
        """The broker was silent for a liveness window; a new DEALER follows.

        It dials the connection's ``endpoint``, which the handler may change
        here (a worker moving to another broker: ``workers.model.broker_choice``).
        """

    def on_malformed(self, error: messages.MalformedMessage,
                     frames: list[bytes]) -> None:
        """A message that did not decode (already logged, counted and
        dropped), and its frames."""

    def on_tick(self, now: float) -> None:
        """Once per poll round, before polling: the application's timers."""

    def heartbeat(self, now: float) -> messages.Message:
        """What the heartbeat due at ``now`` says."""
        return messages.Heartbeat()

    def forward(self, msg: messages.Message) -> bool:
        """Last look at a message another thread passed to ``send``, just
        before it goes out; False drops it."""
        return True


class _Wakeup:
    """A file descriptor that becomes readable when another thread has work
    for the link thread (``zmq.Poller`` accepts raw fds).

    ``notify`` writes only if no wake-up is pending. The reader ``clear``s
    (reads, then resets the flag) *before* taking work, so a ``notify`` that
    saw the flag still set is covered by that take.
    """

    def __init__(self) -> None:
        self._eventfd = hasattr(os, "eventfd")
        if self._eventfd:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._read_fd = self._write_fd = fd
        else:  # not Linux: a pipe does the same, one byte per wake-up
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
        self._pending = False
        # The fds live exactly as long as this object: a sender racing
        # ``stop`` must never write into an fd number reused for a file.
        weakref.finalize(self, _close_fds, {self._read_fd, self._write_fd})

    def fileno(self) -> int:
        return self._read_fd

    def notify(self) -> None:
        if self._pending:
            return
        self._pending = True
        try:
            if self._eventfd:
                os.eventfd_write(self._write_fd, 1)
            else:
                os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the reader is already due to wake

    def clear(self) -> None:
        try:
            if self._eventfd:
                os.eventfd_read(self._read_fd)  # resets the count to zero
            else:
                while os.read(self._read_fd, 4096):
                    pass
        except BlockingIOError:
            pass  # nothing was pending
        self._pending = False


def _close_fds(fds: set[int]) -> None:
    for fd in fds:
        os.close(fd)


class BrokerConnection:
    """One DEALER to the broker, its thread, its heartbeats and its outbox.

    ``send`` is safe from any thread. Everything else that touches the socket
    happens in the link's thread; ``last_heard``, ``malformed_dropped``,
    ``losses`` and ``unsent_dropped`` are plain values any thread may read.
    """

    def __init__(
        self,
        endpoint: str,
        handler: LinkHandler,
        *,
        heartbeat_interval_s: float,
        heartbeat_liveness: int,
        curve: ClientKeys | None = None,
        ctx: zmq.Context | None = None,
        linger_ms: int = 0,
        name: str = "broker-link",
    ) -> None:
        """
        Args:
            endpoint: the broker's ZeroMQ endpoint for this kind of peer.
            handler: the application's callbacks.
            heartbeat_interval_s: how often to heartbeat and check for silence.
            heartbeat_liveness: intervals of silence after which the broker
                is taken for gone.
            curve: client keys for an encrypted link; None for plaintext.
            ctx: the ZeroMQ context (default: the process's shared one).
            linger_ms: how long frames still queued at ``stop`` may take to
                leave (a worker's goodbye); a lost broker's DEALER never
                lingers.
            name: the thread's name.
        """
        self.endpoint = endpoint
        self.handler = handler
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.curve = curve
        self.ctx = ctx or zmq.Context.instance()
        self.linger_ms = linger_ms
        #: monotonic time the broker was last heard from (0: never).
        self.last_heard = 0.0
        self.malformed_dropped = 0
        #: How many times the broker went silent and the link reconnected.
        self.losses = 0
        #: Messages dropped because the connection was gone for good.
        self.unsent_dropped = 0
        #: Exceptions raised by the handler's callbacks (logged, survived).
        self.callback_errors = 0
        #: Messages from other threads, encoded by their sender.
        self._outbox: collections.deque[tuple[messages.Message, list[bytes]]] = (
            collections.deque())
        self._wakeup = _Wakeup()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread_id: int | None = None
        self._sock: zmq.Socket | None = None
        self._connected_at = 0.0

    # --- any thread ------------------------------------------------------------

    def start(self) -> BrokerConnection:
        """Start the link's thread, which connects at once."""
        self._thread.start()
        return self

    def send(self, msg: messages.Message, frames: list[bytes] | None = None) -> None:
        """Send ``msg`` to the broker, in order with this thread's other sends.

        From another thread it is queued for the link thread (and the
        handler's ``forward`` sees it there); from the link thread, in a
        callback, it goes out at once. After ``stop`` it is dropped.
        ``frames``: ``msg.to_wire()``, if the caller has it already.
        """
        # Encoded here: a message that cannot be encoded raises in the code
        # that made it, not in the link thread, and the encoding work is
        # spread over the senders.
        if frames is None:
            frames = msg.to_wire()
        if threading.get_ident() == self._thread_id:
            self._write(frames)
        elif not self._stopping:
            self._outbox.append((msg, frames))
            self._wakeup.notify()

    def stop(self) -> None:
        """Ask the link thread to end: it forwards what is queued, closes the
        DEALER (lingering ``linger_ms``) and returns. Safe from a callback."""
        self._stopping = True
        if threading.get_ident() != self._thread_id:
            self._wakeup.notify()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the link thread to end; True if it has (or never ran)."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def alive(self, now: float | None = None) -> bool:
        """Whether the broker was heard from within the liveness window."""
        now = time.monotonic() if now is None else now
        return self.last_heard > 0 and now - self.last_heard < self.silence_window_s

    @property
    def silence_window_s(self) -> float:
        """How long the broker may be silent before it is taken for gone."""
        return self.heartbeat_interval_s * self.heartbeat_liveness

    # --- the link thread ---------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        sock = self._sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a full pipe must not drop frames silently. The
        # credit window bounds what is in flight (see ``protocol.timing``).
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # The largest frame the broker sends (a SUBMIT to a worker, a STATUS
        # reply to a frontend); libzmq drops a "broker" that sends more
        # before buffering it, and the liveness window brings a new DEALER.
        sock.setsockopt(zmq.MAXMSGSIZE, limits.MAX_FRAME_FROM_BROKER)
        # A TCP connect whose SYNs went unanswered (a cable out, a host
        # down) is given up after one window and retried at once, instead of
        # waiting on the kernel's SYN back-off (up to minutes): the DEALER
        # reaches a broker that is back within a window, whatever the link's
        # own back-off.
        sock.setsockopt(zmq.CONNECT_TIMEOUT,
                        min(max(int(self.silence_window_s * 1000), 1), INT_MAX))
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        self._connected_at = time.monotonic()
        self._guarded(self.handler.on_connect)
        return sock

    def _run(self) -> None:
        self._thread_id = threading.get_ident()
        interval_s = self.heartbeat_interval_s
        base_window_s = self.silence_window_s
        #: How long a new connection may stay silent; doubles after each one
        #: that heard nothing (below).
        unheard_window_s = base_window_s
        poller = zmq.Poller()
        wakeup_fd = self._wakeup.fileno()
        poller.register(wakeup_fd, zmq.POLLIN)
        next_beat = 0.0  # the first heartbeat goes out at once
        try:
            sock = self._connect()
            poller.register(sock, zmq.POLLIN)
            while True:
                self._guarded(self.handler.on_tick, time.monotonic())
                if self._stopping:
                    self._forward_outbox()
                    break
                # Wake at the silence deadline, not only at the next beat:
                # checked at beats alone, a broker that fell silent just after
                # one was taken for gone up to one interval late, and its
                # streams' clients heard of it window + interval after.
                now = time.monotonic()
                window_s = (base_window_s if self.last_heard >= self._connected_at
                            else unheard_window_s)
                lost_at = max(self.last_heard, self._connected_at) + window_s
                wait_s = max(0.0, min(interval_s, next_beat - now, lost_at - now))
                # Rounded up: libzmq's timeout is whole milliseconds, and a
                # wake-up just short of the deadline would spin until it.
                ready = dict(poller.poll(math.ceil(wait_s * 1000)))
                if wakeup_fd in ready:
                    self._forward_outbox()
                if sock in ready:
                    self._receive()
                now = time.monotonic()
                heard_here = self.last_heard >= self._connected_at
                if heard_here:
                    unheard_window_s = base_window_s
                window_s = base_window_s if heard_here else unheard_window_s
                silent_s = now - max(self.last_heard, self._connected_at)
                if silent_s > window_s:
                    if not heard_here:
                        # Paranoid Pirate's back-off (zguide ch. 4): a broker
                        # too loaded to answer a new connection (handshake,
                        # registration, reply) within one window would
                        # otherwise be redialled forever, each new identity
                        # registering again and never settling. Waiting
                        # longer costs nothing while the broker is down:
                        # the DEALER itself reconnects as soon as it is up.
                        unheard_window_s = min(unheard_window_s * 2,
                                               base_window_s * MAX_BACKOFF)
                    self.losses += 1
                    log.warning("broker %s silent for %.1fs; reconnecting",
                                self.endpoint, silent_s)
                    self._guarded(self.handler.on_lost, silent_s)
                    poller.unregister(sock)
                    sock.close(linger=0)
                    sock = self._connect()
                    poller.register(sock, zmq.POLLIN)
                if now >= next_beat:
                    next_beat = now + interval_s
                    try:
                        beat = self.handler.heartbeat(now)
                    except Exception:
                        # The link (and with it the process's liveness) must
                        # outlive a bug in what the application reports.
                        log.exception("building a heartbeat failed; sent a bare one")
                        beat = messages.Heartbeat()
                    self._write(beat.to_wire())
        finally:
            self._stopping = True  # also if a callback raised: senders drop
            self._thread_id = None
            if self._sock is not None:
                self._sock.close(linger=self.linger_ms)

    def _guarded(self, callback, *args, failed=None):
        """``callback(*args)``; if it raises, log (rate-limited), count and
        return ``failed``. The link thread carries the process's heartbeats
        (and a worker's systemd watchdog pings): a bug in one callback must
        not end it."""
        try:
            return callback(*args)
        except Exception:
            self.callback_errors += 1
            n = self.callback_errors
            if n <= 10 or n % 1000 == 0:
                log.exception("link callback %s failed (#%d); the link goes on",
                              getattr(callback, "__name__", callback), n)
            return failed

    def _forward_outbox(self) -> None:
        # Clear before counting: a message appended after the clear has
        # written a fresh wake-up, so what this round leaves is taken next
        # round. Taking only the count keeps a busy sender from starving
        # receives and heartbeats.
        self._wakeup.clear()
        for _ in range(len(self._outbox)):
            msg, frames = self._outbox.popleft()
            if self._guarded(self.handler.forward, msg, failed=True):
                self._write(frames)

    def _write(self, frames: list[bytes]) -> None:
        # Never blocking. With no high-water mark a DEALER is full only when
        # libzmq has dropped its connection for good: it never retries a
        # refused CURVE handshake. A blocking send would then hang this thread
        # for the life of the process (no heartbeats, no systemd watchdog, no
        # retry once the key is authorised). Dropped instead: the broker stays
        # silent, so the liveness window brings a new DEALER, which redials.
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            self.unsent_dropped += 1

    def _receive(self) -> None:
        n = 0
        while True:
            # Mostly one message per poll round: ask before a second receive
            # rather than build the exception of an empty one.
            if n == 1 and not waiting(self._sock):
                return
            n += 1
            try:
                frames = recv_frames(self._sock)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            try:
                msg = messages.decode(frames)
            except messages.MalformedMessage as exc:
                self.malformed_dropped += 1
                n = self.malformed_dropped
                # A garbage flood must not become a log flood.
                if n <= 10 or n % 1000 == 0:
                    log.warning("dropped malformed message #%d from broker: %s",
                                n, exc)
                self._guarded(self.handler.on_malformed, exc, frames)
                continue
            try:
                self.handler.on_message(msg)
            except Exception:
                # A well-formed message the application cannot handle is as
                # bad as a malformed one, and must not end the link either.
                log.exception("handling %s from the broker failed; dropped",
                              type(msg).__name__)
