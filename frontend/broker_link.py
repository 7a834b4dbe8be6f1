"""One gunicorn process's connection to the broker.

The connection itself (the DEALER and the thread that owns it, heartbeats,
silence, reconnect, decoding) is ``protocol.link.BrokerConnection``, shared
with the model worker. This module is what a frontend makes of it: request
threads send through it without sharing the socket, and get their job's
frames back through a per-job queue. When the broker goes silent or says it
forgot us, every open job receives an ERROR frame, so no request thread
waits forever.

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
from frontend.errors import PayloadTooLarge
from frontend.interfaces import JobOrigin
from protocol import limits, messages
from protocol.curve import ClientKeys
from protocol.errors import ErrorCode
from protocol.link import BrokerConnection, LinkHandler
from protocol.payloads import GenerationRequest, PoolStatus

log = logging.getLogger("llamapool.frontend")

#: Frames the broker link routes to a job's queue.
_JOB_MESSAGES = (
    messages.Accepted,
    messages.NoSlot,
    messages.Queued,
    messages.RateLimited,
    messages.Token,
    messages.Final,
    messages.Error,
    messages.SlotDone,
)


class JobStream:
    """The frames of one job, in arrival order (a ``FrameStream``,
    ``frontend.interfaces``)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        #: Set by the link thread when the broker's ACCEPTED arrives.
        self.accepted = False
        # queue.Queue for every timed wait here, never SimpleQueue: CPython
        # 3.11's SimpleQueue.get(timeout) waits forever if a signal handler
        # returns after the deadline (tests/test_interrupted_waits.py).
        self._frames: queue.Queue[messages.Message] = queue.Queue()

    def put(self, msg: messages.Message) -> None:
        self._frames.put(msg)

    def get(self, timeout_s: float) -> messages.Message | None:
        """Next frame, or None after ``timeout_s`` without one."""
        try:
            return self._frames.get(timeout=timeout_s)
        except queue.Empty:
            return None


class BrokerLink(LinkHandler):
    """Thread-safe access to the broker from many request threads (a
    ``BrokerClient``, ``frontend.interfaces``)."""

    def __init__(
        self,
        endpoint: str,
        *,
        heartbeat_interval_s: float,
        heartbeat_liveness: int,
        curve: ClientKeys | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        """``ctx``: a context to share (tests: ``inproc://`` endpoints need
        the broker's own); by default the link makes its process's own when
        it starts, after the fork."""
        self.endpoint = endpoint
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.curve = curve
        self._ctx = ctx
        self._start_lock = threading.Lock()
        self._streams: dict[str, JobStream] = {}
        self._status_waiters: dict[str, queue.Queue] = {}
        #: The newest STATUS reply and when it arrived (monotonic), for
        #: callers that accept a slightly stale ledger.
        self._latest_status: tuple[float, PoolStatus] | None = None
        self._started_pid: int | None = None
        self._conn: BrokerConnection | None = None
        self.malformed_dropped = 0
        self.broker_losses = 0

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> BrokerLink:
        """Start the connection once per process (safe to call every request)."""
        if self._started_pid == os.getpid():
            return self
        with self._start_lock:
            if self._started_pid == os.getpid():
                return self
            self._conn = BrokerConnection(
                self.endpoint, self,
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_liveness=self.heartbeat_liveness,
                curve=self.curve,
                # This process's own, made after the fork, unless one was given.
                ctx=self._ctx or zmq.Context(),
                name="broker-link",
            )
            self._conn.start()  # after the assignment: callbacks use it
            self._started_pid = os.getpid()
        return self

    def close(self) -> None:
        if self._conn is not None:
            self._conn.stop()
            self._conn.join(timeout_s=2)

    # --- request-thread API ------------------------------------------------------

    def send(self, msg: messages.Message) -> None:
        self._conn.send(msg)

    def submit(self, job_id: str, request: GenerationRequest,
               prefix_blocks: list[int] | None = None,
               id_slot: int = -1, origin: JobOrigin | None = None) -> JobStream:
        """Open the job's stream, then send SUBMIT (so no frame can be missed).

        Raises:
            PayloadTooLarge: the SUBMIT would exceed the wire's ceiling
                (``protocol.limits.MAX_SUBMIT_BYTES``).
        """
        self.start()
        origin = origin or JobOrigin()
        msg = messages.Submit(job_id, request, prefix_blocks or [], id_slot,
                              origin.request_id[:limits.MAX_ID_CHARS],
                              origin.key[:limits.MAX_KEY_LABEL_CHARS],
                              origin.trace, origin.client, origin.max_wait_s,
                              key_policy=origin.key_policy)
        frames = msg.to_wire()
        size = len(frames[2])
        if size > messages.Submit.LIMITS.max_bytes:
            # The broker would drop it as malformed and the client would wait
            # for nothing: refuse here, naming the limit.
            raise PayloadTooLarge(
                f"the request encodes to {size} bytes for the pool; at most "
                f"{messages.Submit.LIMITS.max_bytes}")
        stream = JobStream(job_id)
        self._streams[job_id] = stream
        self._conn.send(msg, frames)
        return stream

    def slot_action(self, msg: messages.SlotAction) -> JobStream:
        """Open the action's stream, then send it; its one answer is
        SLOT_DONE, or NO_SLOT or ERROR from the broker
        (``frontend.slot_actions``)."""
        self.start()
        stream = JobStream(msg.job_id)
        self._streams[msg.job_id] = stream
        self._conn.send(msg)
        return stream

    def forget(self, job_id: str) -> None:
        """Stop routing frames to this job (late frames are dropped)."""
        self._streams.pop(job_id, None)

    def cached_status(self, max_age_s: float) -> PoolStatus | None:
        """The last snapshot if it is at most ``max_age_s`` old, the broker
        alive and a worker loaded (``status``'s rule); else None, at once."""
        latest = self._latest_status
        if (max_age_s > 0 and latest is not None and latest[1].slots_total > 0
                and self.broker_alive()
                and time.monotonic() - latest[0] <= max_age_s):
            return latest[1]
        return None

    def status(self, timeout_s: float, max_age_s: float = 0.0) -> PoolStatus | None:
        """The broker's ledger snapshot, or None if it does not answer in time.

        With ``max_age_s``, a snapshot that arrived that recently is returned
        without asking again, while the broker is alive and the snapshot shows
        a loaded worker: a pool still loading is asked each time, so every
        process reports it ready as soon as it is.
        """
        self.start()
        cached = self.cached_status(max_age_s)
        if cached is not None:
            return cached
        request_id = uuid.uuid4().hex
        waiter: queue.Queue = queue.Queue()  # see JobStream._frames
        self._status_waiters[request_id] = waiter
        try:
            self.send(messages.Status(request_id))
            return waiter.get(timeout=timeout_s)
        except queue.Empty:
            return None
        finally:
            self._status_waiters.pop(request_id, None)

    @property
    def latest_status(self) -> PoolStatus | None:
        """The newest STATUS reply, however old (None: none since the broker
        was last lost): which models this broker serves, for routing."""
        latest = self._latest_status
        return None if latest is None else latest[1]

    @property
    def last_heard(self) -> float:
        """monotonic time the broker was last heard from (0: never)."""
        return self._conn.last_heard if self._conn is not None else 0.0

    def broker_alive(self) -> bool:
        return self._conn is not None and self._conn.alive()

    # --- the link thread (LinkHandler) -------------------------------------------

    def on_connect(self) -> None:
        self._conn.send(messages.Hello(os.getpid(), socket.gethostname()))

    def on_message(self, msg: messages.Message) -> None:
        if isinstance(msg, _JOB_MESSAGES):
            stream = self._streams.get(msg.job_id)
            if stream is not None:
                if isinstance(msg, messages.Accepted):
                    stream.accepted = True
                stream.put(msg)
        elif isinstance(msg, messages.StatusReply):
            self._latest_status = (time.monotonic(), msg.snapshot)
            waiter = self._status_waiters.get(msg.request_id)
            if waiter is not None:
                waiter.put(msg.snapshot)
        elif isinstance(msg, messages.Disconnect):
            # The broker restarted and forgot us: the jobs it had accepted
            # are gone too. A SUBMIT not yet answered is not: frames are
            # ordered, so its answer (from the new broker, which registers
            # us on SUBMIT) still comes after this DISCONNECT.
            log.warning("broker says %r; registering again", msg.reason)
            self._fail_all(ErrorCode.BROKER_RESTARTED, "the broker restarted",
                           accepted_only=True)
            self._conn.send(messages.Hello(os.getpid(), socket.gethostname()))
            # The broker answers STATUS only to registered frontends, so a
            # STATUS it refused with this DISCONNECT is asked again, after
            # the HELLO (frames are ordered): /health does not fail for a
            # broker restart it could have answered.
            for request_id in list(self._status_waiters):
                self._conn.send(messages.Status(request_id))

    def on_lost(self, silent_s: float) -> None:
        self._latest_status = None
        self.broker_losses += 1
        log.warning("lost the broker; failing %d open jobs", len(self._streams))
        self._fail_all(ErrorCode.BROKER_UNREACHABLE, "lost contact with the broker")

    def on_malformed(self, error: messages.MalformedMessage,
                     frames: list[bytes]) -> None:
        self.malformed_dropped += 1
        metrics.FRONTEND_MALFORMED.inc()
        # The broker relays TOKEN bodies without decoding them
        # (``messages.is_token_of``), so a broken one is found here. Its job
        # has lost output: it fails, and the CANCEL tells the broker why, so
        # the worker is treated as one that broke the protocol.
        job_id = messages.claimed_job_id(frames)
        stream = self._streams.pop(job_id, None) if job_id is not None else None
        if stream is None:
            return
        stream.put(messages.Error(job_id, ErrorCode.WORKER_PROTOCOL_ERROR,
                                  "the model worker sent a malformed frame"))
        self._conn.send(messages.Cancel(job_id, broken=str(error)))

    def _fail_all(self, code: ErrorCode, message: str,
                  accepted_only: bool = False) -> None:
        for job_id, stream in list(self._streams.items()):
            if stream.accepted or not accepted_only:
                stream.put(messages.Error(job_id, code, message))
