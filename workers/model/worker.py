"""A model worker process: one engine, one slot, one job at a time.

Two threads, each owning its own sockets (ZeroMQ sockets are not thread-safe):

* the main thread runs jobs through the engine and pushes encoded frames into
  an in-process PUSH socket;
* the I/O thread owns the DEALER to the broker. It forwards those frames,
  receives SUBMIT / CANCEL / CREDIT, and heartbeats every interval, also
  while a token is being computed (ctypes releases the GIL during decode).

The worker sends READY only after the model has loaded, and again whenever the
broker says DISCONNECT or goes silent (a restarted broker rebuilds its ledger
from these). SIGTERM: stop taking jobs, let the current one finish within the
grace period or end it with an ERROR, tell the broker, exit 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from protocol import messages, timing
from protocol.curve import ClientKeys
from protocol.lifecycle import ServiceNotifier, SilentNotifier, StopSignal
from protocol.payloads import JobProgress
from workers.model.engine import Engine, RequestRejected

log = logging.getLogger("llamapool.worker")


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    broker_endpoint: str
    heartbeat_interval_s: float = timing.HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = timing.HEARTBEAT_LIVENESS
    credit_window_frames: int = timing.CREDIT_WINDOW_FRAMES
    stall_timeout_s: float = timing.STALL_TIMEOUT_S
    #: After SIGTERM, how long the running job may continue before it is ended.
    shutdown_grace_s: float = 30.0
    worker_name: str = ""
    #: CURVE keys for the link to the broker (``protocol.curve``); None: plaintext.
    curve: ClientKeys | None = None


_NONE, _SENT, _CONFIRMED = "none", "sent", "confirmed"


class EngineLoadError(RuntimeError):
    """The model (engine) could not be loaded; the worker cannot serve."""


class ActiveJob:
    """One running job; the engine sees it as its ``JobSink``."""

    def __init__(
        self, submit: messages.Submit, outbox: zmq.Socket, settings: WorkerSettings
    ) -> None:
        self.job_id = submit.job_id
        self.request = submit.request
        self._outbox = outbox
        self._stall_timeout_s = settings.stall_timeout_s
        self._credit = settings.credit_window_frames
        self._credit_changed = threading.Condition()
        self._cancelled = threading.Event()
        #: Set when the job is ended by a worker shutdown, not by its client.
        self.ended_by_shutdown = False
        #: Set when the broker that gave us this job is gone: its frames are
        #: dropped instead of confusing a new broker.
        self.orphaned = False
        # The engine's latest report_progress() arguments; () before the first.
        self._progress: tuple = ()
        self.stalled = False

    # --- called by the I/O thread ------------------------------------------------

    def cancel(self) -> None:
        self._cancelled.set()
        with self._credit_changed:
            self._credit_changed.notify_all()

    def add_credit(self, frames: int) -> None:
        with self._credit_changed:
            self._credit += max(0, frames)
            self._credit_changed.notify_all()

    # --- JobSink, called by the engine in the main thread ------------------------

    def emit(self, text: str, n_tokens: int) -> None:
        with self._credit_changed:
            self._credit -= 1
        self._outbox.send_multipart(
            messages.Token(self.job_id, text, n_tokens).to_wire()
        )

    def should_stop(self) -> bool:
        return self._cancelled.is_set()

    def wait_for_credit(self) -> bool:
        """Pause while the client is not reading; give up after the stall timeout."""
        deadline = time.monotonic() + self._stall_timeout_s
        with self._credit_changed:
            while self._credit <= 0 and not self._cancelled.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stalled = True
                    return False
                self._credit_changed.wait(remaining)
        return not self._cancelled.is_set()

    def report_progress(self, n_prompt, n_generated, max_tokens, tokens_per_s,
                        n_ctx_used) -> None:
        # Called for every token: keep just a tuple, replaced whole so the I/O
        # thread always reads a consistent set. The typed JobProgress is built
        # once per heartbeat, in progress().
        self._progress = (n_prompt, n_generated, max_tokens, tokens_per_s,
                          n_ctx_used)

    # --- called by the I/O thread, for heartbeats --------------------------------

    def progress(self) -> JobProgress:
        return JobProgress(self.job_id, *self._progress)


class ModelWorker:
    """Connects one engine to the broker."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], Engine],
        model_label: str,
        ctx: zmq.Context | None = None,
        notifier: ServiceNotifier | None = None,
    ) -> None:
        self.settings = settings
        self._load_engine = load_engine
        self.model_label = model_label
        #: None until the model has loaded; the I/O thread sends LOADING
        #: heartbeats until then, and READY after.
        self.engine: Engine | None = None
        self.ctx = ctx or zmq.Context.instance()
        self.name = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self._jobs: queue.SimpleQueue[ActiveJob] = queue.SimpleQueue()
        self._outbox_endpoint = f"inproc://worker-outbox-{uuid.uuid4().hex}"
        self._io_done = threading.Event()
        self.malformed_dropped = 0
        self.jobs_done = 0
        self._sd = notifier or SilentNotifier()
        self.tokens_generated = 0
        self.busy = False

    # --- main thread -------------------------------------------------------------

    def run(self, stop: StopSignal) -> None:
        """Serve jobs until ``stop`` is set and the current job has ended."""
        inbox = self.ctx.socket(zmq.PULL)
        inbox.bind(self._outbox_endpoint)
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)
        outbox.connect(self._outbox_endpoint)
        io = threading.Thread(
            target=self._io_loop, args=(inbox, outbox, stop), name="worker-io",
            daemon=True,
        )
        io.start()
        try:
            try:
                self.engine = self._load_engine()
            except Exception as exc:
                raise EngineLoadError(str(exc)) from exc
            log.info("model loaded: %s (n_ctx=%d)", self.engine.model_name,
                     self.engine.n_ctx)
            while not stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._run_job(job, outbox)
            # A job may have been handed over just before the stop.
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                job.ended_by_shutdown = True
                job.cancel()
                self._run_job(job, outbox)
        finally:
            stop.set()  # also on a failed load: the I/O thread says goodbye
            self._io_done.wait(timeout=self.settings.heartbeat_interval_s * 3)
            outbox.close(linger=0)
            log.info("worker %s stopped after %d jobs", self.name, self.jobs_done)

    def _run_job(self, job: ActiveJob, outbox: zmq.Socket) -> None:
        self.busy = True
        try:
            if job.ended_by_shutdown:
                raise RequestRejected(
                    "worker_shutdown", "the worker is shutting down", 503
                )
            result = self.engine.run(job.request, job)
            self.tokens_generated += result.completion_tokens
            if job.ended_by_shutdown:
                msg = messages.Error(
                    job.job_id, "worker_shutdown",
                    "the worker shut down before the job finished", 503,
                )
            elif job.stalled:
                msg = messages.Error(
                    job.job_id, "client_stalled",
                    "the client stopped reading; generation was cancelled", 408,
                )
            else:
                msg = messages.Final(
                    job.job_id, result.finish_reason, result.usage(),
                    result.timings(), result.tail_text,
                )
        except RequestRejected as exc:
            msg = messages.Error(job.job_id, exc.code, exc.message, exc.status)
        except Exception:
            log.exception("job %s failed in the engine", job.job_id)
            msg = messages.Error(job.job_id, "engine_error", "generation failed", 500)
        self.jobs_done += 1
        self.busy = False
        outbox.send_multipart(msg.to_wire())

    # --- I/O thread --------------------------------------------------------------

    def _new_dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)
        if self.settings.curve is not None:
            self.settings.curve.apply(sock)
        sock.connect(self.settings.broker_endpoint)
        return sock

    def _ready_message(self) -> messages.Ready:
        return messages.Ready(
            worker_name=self.name,
            model=self.engine.model_name,
            n_ctx=self.engine.n_ctx,
            pid=os.getpid(),
            host=socket.gethostname(),
            engine=self.engine.name,
        )

    def _io_loop(self, inbox: zmq.Socket, outbox: zmq.Socket, stop: StopSignal) -> None:
        s = self.settings
        dealer = self._new_dealer()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        job: ActiveJob | None = None  # the job the broker believes we run
        # Registration: NONE -> (READY sent) SENT -> (broker answered) CONFIRMED.
        # While SENT, a DISCONNECT is stale: the broker sent it in answer to
        # something we sent before READY (frames are ordered both ways), so
        # obeying it would register us twice and orphan the job the broker
        # may already have given us.
        registration = _NONE
        ready_sent_at = 0.0
        last_heard = time.monotonic()
        next_beat = 0.0
        grace_deadline = None
        beat_ms = s.heartbeat_interval_s * 1000
        try:
            while True:
                now = time.monotonic()
                if registration == _SENT and (
                        now - ready_sent_at > s.heartbeat_interval_s
                        * s.heartbeat_liveness):
                    registration = _NONE  # READY went to a broker that died
                if (registration == _NONE and job is None
                        and self.engine is not None and not stop.is_set()):
                    dealer.send_multipart(self._ready_message().to_wire())
                    registration, ready_sent_at = _SENT, now
                    log.info("worker %s sent READY", self.name)
                if stop.is_set() and grace_deadline is None:
                    grace_deadline = now + s.shutdown_grace_s
                    self._sd.stopping("draining")
                    # Stop taking work before anything else.
                    dealer.send_multipart(messages.Disconnect("stopping").to_wire())
                if grace_deadline is not None:
                    if job is None:
                        break
                    if now >= grace_deadline:
                        job.ended_by_shutdown = True
                        job.cancel()
                ready = dict(poller.poll(min(beat_ms, max(0, next_beat - now) * 1000)))
                if inbox in ready:
                    job = self._forward_outbox(inbox, dealer, job)
                if dealer in ready:
                    last_heard = time.monotonic()
                    job, registration = self._drain_broker(
                        dealer, outbox, job, registration)
                    if registration == _CONFIRMED:
                        # READY went out and the broker answered: we serve.
                        self._sd.ready(f"registered with {s.broker_endpoint}")
                now = time.monotonic()
                if now - last_heard > s.heartbeat_interval_s * s.heartbeat_liveness:
                    log.warning("broker silent for %.1fs; reconnecting",
                                now - last_heard)
                    poller.unregister(dealer)
                    dealer.close(linger=0)
                    dealer = self._new_dealer()
                    poller.register(dealer, zmq.POLLIN)
                    registration = _NONE
                    last_heard = now
                    if job is not None:
                        job.orphaned = True
                        job.cancel()
                if now >= next_beat:
                    if self.engine is None:
                        beat = messages.Loading(self.name, self.model_label,
                                                os.getpid(), socket.gethostname())
                    else:
                        beat = messages.Heartbeat(
                            job.progress() if job is not None else None)
                    dealer.send_multipart(beat.to_wire())
                    next_beat = now + s.heartbeat_interval_s
                    self._sd.watchdog(now)
        finally:
            dealer.close(linger=500)
            inbox.close(linger=0)
            self._io_done.set()

    def _forward_outbox(self, inbox, dealer, job: ActiveJob | None):
        while True:
            try:
                frames = inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return job
            terminal = frames[1] in (messages.Final.COMMAND, messages.Error.COMMAND)
            if job is not None and not job.orphaned:
                dealer.send_multipart(frames)
            if terminal:
                job = None

    def _drain_broker(self, dealer, outbox, job: ActiveJob | None,
                      registration: str):
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return job, registration
            try:
                msg = messages.decode(frames)
            except messages.MalformedMessage as exc:
                self.malformed_dropped += 1
                log.warning("dropped malformed message from broker: %s", exc)
                continue
            if registration == _SENT and not isinstance(msg, messages.Disconnect):
                registration = _CONFIRMED  # the broker knows us since READY
            if isinstance(msg, messages.Submit):
                if job is not None:
                    # The broker thinks we are idle while we are not; refuse
                    # rather than queue (one slot means one job).
                    dealer.send_multipart(
                        messages.Error(msg.job_id, "worker_busy", "slot busy", 503)
                        .to_wire()
                    )
                    continue
                job = ActiveJob(msg, outbox, self.settings)
                self._jobs.put(job)
            elif isinstance(msg, messages.Cancel):
                if job is not None and job.job_id == msg.job_id:
                    job.cancel()
            elif isinstance(msg, messages.Credit):
                if job is not None and job.job_id == msg.job_id:
                    job.add_credit(msg.frames)
            elif isinstance(msg, messages.Disconnect):
                if registration == _SENT:
                    continue  # stale: see _io_loop
                log.warning("broker says %r; registering again", msg.reason)
                registration = _NONE
                if job is not None:
                    job.orphaned = True
                    job.cancel()
            # HEARTBEAT: hearing from the broker was the point.
