"""One gunicorn process's connection to the broker.

A single I/O thread owns the DEALER socket (ZeroMQ sockets are not
thread-safe). Request threads hand it messages through a lock-guarded PUSH
socket and get frames back through a per-job queue. The I/O thread also
heartbeats the broker and notices when it is gone; every open job then
receives an ERROR frame, so no request thread waits forever.

Create the link after gunicorn forks (``start`` is lazy and idempotent): a
ZeroMQ context must never cross a ``fork()``.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid

import zmq

from frontend import metrics
from protocol import messages
from protocol.curve import ClientKeys
from protocol.payloads import GenerationRequest, PoolStatus

log = logging.getLogger("llamapool.frontend")

#: Frames the broker link routes to a job's queue.
_JOB_MESSAGES = (
    messages.Accepted,
    messages.NoSlot,
    messages.Token,
    messages.Final,
    messages.Error,
)


class JobStream:
    """The frames of one job, in arrival order."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        #: Set by the I/O thread when the broker's ACCEPTED arrives.
        self.accepted = False
        self._frames: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()

    def put(self, msg: messages.Message) -> None:
        self._frames.put(msg)

    def get(self, timeout_s: float) -> messages.Message | None:
        """Next frame, or None after ``timeout_s`` without one."""
        try:
            return self._frames.get(timeout=timeout_s)
        except queue.Empty:
            return None


class BrokerLink:
    """Thread-safe access to the broker from many request threads."""

    def __init__(
        self,
        endpoint: str,
        *,
        heartbeat_interval_s: float,
        heartbeat_liveness: int,
        curve: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.curve = curve
        self._start_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[str, JobStream] = {}
        self._status_waiters: dict[str, queue.SimpleQueue] = {}
        self._started_pid: int | None = None
        self._stop = threading.Event()
        self._push: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        #: monotonic time the broker was last heard from (0: never).
        self.last_heard = 0.0
        self.malformed_dropped = 0
        self.broker_losses = 0

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> BrokerLink:
        """Start the I/O thread once per process (safe to call every request)."""
        if self._started_pid == os.getpid():
            return self
        with self._start_lock:
            if self._started_pid == os.getpid():
                return self
            self._ctx = zmq.Context()
            outbox = f"inproc://frontend-outbox-{uuid.uuid4().hex}"
            pull = self._ctx.socket(zmq.PULL)
            pull.bind(outbox)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._push.connect(outbox)
            self._thread = threading.Thread(
                target=self._io_loop, args=(pull,), name="broker-link", daemon=True
            )
            self._thread.start()
            self._started_pid = os.getpid()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # --- request-thread API ------------------------------------------------------

    def send(self, msg: messages.Message) -> None:
        frames = msg.to_wire()
        with self._send_lock:
            self._push.send_multipart(frames)

    def submit(self, job_id: str, request: GenerationRequest,
               prefix_blocks: list[int] | None = None) -> JobStream:
        """Open the job's stream, then send SUBMIT (so no frame can be missed)."""
        self.start()
        stream = JobStream(job_id)
        self._streams[job_id] = stream
        self.send(messages.Submit(job_id, request, prefix_blocks or []))
        return stream

    def forget(self, job_id: str) -> None:
        """Stop routing frames to this job (late frames are dropped)."""
        self._streams.pop(job_id, None)

    def status(self, timeout_s: float) -> PoolStatus | None:
        """The broker's ledger snapshot, or None if it does not answer in time."""
        self.start()
        request_id = uuid.uuid4().hex
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        self._status_waiters[request_id] = waiter
        try:
            self.send(messages.Status(request_id))
            return waiter.get(timeout=timeout_s)
        except queue.Empty:
            return None
        finally:
            self._status_waiters.pop(request_id, None)

    def broker_alive(self) -> bool:
        window = self.heartbeat_interval_s * self.heartbeat_liveness
        return self.last_heard > 0 and time.monotonic() - self.last_heard < window

    # --- I/O thread --------------------------------------------------------------

    def _new_dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        sock.send_multipart(messages.Hello(os.getpid(), socket.gethostname()).to_wire())
        return sock

    def _io_loop(self, pull: zmq.Socket) -> None:
        dealer = self._new_dealer()
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        interval_s = self.heartbeat_interval_s
        timeout_s = interval_s * self.heartbeat_liveness
        connected_at = time.monotonic()
        next_beat = connected_at + interval_s
        heartbeat = messages.Heartbeat().to_wire()
        while not self._stop.is_set():
            now = time.monotonic()
            wait_ms = max(0.0, min(interval_s, next_beat - now)) * 1000
            ready = dict(poller.poll(wait_ms))
            if pull in ready:
                self._forward(pull, dealer)
            if dealer in ready:
                self._drain(dealer)
            now = time.monotonic()
            if now - max(self.last_heard, connected_at) > timeout_s:
                self.broker_losses += 1
                log.warning("broker silent for %.1fs; failing open jobs", timeout_s)
                self._fail_all("broker_unreachable", "lost contact with the broker")
                poller.unregister(dealer)
                dealer.close(linger=0)
                dealer = self._new_dealer()
                poller.register(dealer, zmq.POLLIN)
                connected_at = now
            if now >= next_beat:
                dealer.send_multipart(heartbeat)
                next_beat = now + interval_s
        dealer.close(linger=0)
        pull.close(linger=0)

    def _forward(self, pull: zmq.Socket, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            dealer.send_multipart(frames)

    def _drain(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            try:
                msg = messages.decode(frames)
            except messages.MalformedMessage as exc:
                self.malformed_dropped += 1
                metrics.FRONTEND_MALFORMED.inc()
                log.warning("dropped malformed message from broker: %s", exc)
                continue
            if isinstance(msg, _JOB_MESSAGES):
                stream = self._streams.get(msg.job_id)
                if stream is not None:
                    if isinstance(msg, messages.Accepted):
                        stream.accepted = True
                    stream.put(msg)
            elif isinstance(msg, messages.StatusReply):
                waiter = self._status_waiters.get(msg.request_id)
                if waiter is not None:
                    waiter.put(msg.snapshot)
            elif isinstance(msg, messages.Disconnect):
                # The broker restarted and forgot us: the jobs it had accepted
                # are gone too. A SUBMIT not yet answered is not: frames are
                # ordered, so its answer (from the new broker, which registers
                # us on SUBMIT) still comes after this DISCONNECT.
                log.warning("broker says %r; registering again", msg.reason)
                self._fail_all("broker_restarted", "the broker restarted",
                               accepted_only=True)
                dealer.send_multipart(
                    messages.Hello(os.getpid(), socket.gethostname()).to_wire()
                )

    def _fail_all(self, code: str, message: str, accepted_only: bool = False) -> None:
        for job_id, stream in list(self._streams.items()):
            if stream.accepted or not accepted_only:
                stream.put(messages.Error(job_id, code, message, 503))
