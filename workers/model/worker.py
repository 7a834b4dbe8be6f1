"""A model worker process: one engine, one slot, one job at a time.

Two threads:

* the main thread runs jobs through the engine and hands their frames to the
  broker connection (``protocol.link``); between jobs, when none waits, it
  gives the engine its idle time (saving the prompt state just finished);
* the connection's thread owns the DEALER to the broker. It sends those
  frames, heartbeats every interval (also while a token is being computed:
  ctypes releases the GIL during decode), and calls this module back with
  SUBMIT / CANCEL / CREDIT / DISCONNECT and when the broker goes silent.

This module keeps only what is a worker's own: which job the broker believes
we run, registration, and shutdown. The worker sends READY only after the
model has loaded, and again whenever the broker says DISCONNECT or goes
silent (a restarted broker rebuilds its ledger from these). SIGTERM: stop
taking jobs, let the current one finish within the grace period or end it
with an ERROR, tell the broker, exit 0.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

import zmq

from protocol import messages, worker_phase
from protocol.broker_list import split_endpoints
from protocol.curve import client_keys
from protocol.errors import ErrorCode
from protocol.lifecycle import ServiceNotifier, SilentNotifier, StopSignal
from protocol.link import BrokerConnection, LinkHandler
from protocol.payloads import JobProgress
from workers.model import crash_on_demand
from workers.model.broker_choice import BrokerChoice
from workers.model.crash_on_demand import crash_if_asked
from workers.model.engine import Engine, RequestRejected
from workers.model.settings import WorkerSettings

log = logging.getLogger("llamapool.worker")




class EngineLoadError(RuntimeError):
    """The model (engine) could not be loaded; the worker cannot serve."""


class RegistrationState(enum.Enum):
    NONE = "none"
    SENT = "sent"
    CONFIRMED = "confirmed"


class Registration:
    """Whether the broker has this worker in its ledger.

    NONE -> (READY sent) SENT -> (the broker answered) CONFIRMED; back to
    NONE when the broker says DISCONNECT or goes silent, or when a READY stays
    unanswered for a liveness window (it went to a broker that died).

    While SENT, a DISCONNECT is stale: the broker sent it in answer to
    something we sent before READY (frames are ordered both ways), so obeying
    it would register us twice and orphan the job the broker may already have
    given us.
    """

    def __init__(self, answer_timeout_s: float) -> None:
        self.state = RegistrationState.NONE
        self._answer_timeout_s = answer_timeout_s
        self._sent_at = 0.0

    @property
    def confirmed(self) -> bool:
        return self.state is RegistrationState.CONFIRMED

    def needs_ready(self, now: float) -> bool:
        """Whether a READY should go out (given that we can serve)."""
        if (self.state is RegistrationState.SENT
                and now - self._sent_at > self._answer_timeout_s):
            self.state = RegistrationState.NONE
        return self.state is RegistrationState.NONE

    def ready_sent(self, now: float) -> None:
        self.state, self._sent_at = RegistrationState.SENT, now

    def heard(self, msg: messages.Message) -> bool:
        """Account for a message from the broker; False if it is a stale
        DISCONNECT, to be ignored."""
        if self.state is RegistrationState.SENT:
            if isinstance(msg, messages.Disconnect):
                return False
            self.state = RegistrationState.CONFIRMED  # it knows us since READY
        return True

    def forget(self) -> None:
        """The broker no longer knows us (DISCONNECT, or it went silent)."""
        self.state = RegistrationState.NONE


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    """``--threads auto``: the thread count the broker last gave this worker
    (THREADS), when it arrived, and its sequence number (each budget is
    confirmed to the broker once, with THREADS_SET)."""

    n_threads: int
    told_at: float = 0.0
    seq: int = 0


class ActiveJob:
    """One running job; the engine sees it as its ``JobSink``."""

    def __init__(
        self,
        submit: messages.Submit,
        send: Callable[[messages.Message], None],
        settings: WorkerSettings,
        wanted_threads: Callable[[], ThreadBudget | None] = lambda: None,
    ) -> None:
        self.job_id = submit.job_id
        self.request = submit.request
        self._send = send
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
        #: monotonic time the job began waiting for credit; None: not waiting.
        self._paused_since: float | None = None
        #: The worker's current thread budget, when it arrived and its
        #: sequence number (None: fixed --threads).
        self._wanted_threads = wanted_threads
        #: Threads the engine decodes with now (0: not reported yet).
        self._threads_in_use = 0
        #: The last budget (sequence number) confirmed to the broker.
        self._confirmed_budget = -1

    # --- called by the link thread -----------------------------------------------

    @property
    def paused(self) -> bool:
        """Waiting for credit: not decoding, and it applies a new thread
        budget before it decodes again."""
        return self._paused_since is not None

    def cancel(self) -> None:
        self._cancelled.set()
        with self._credit_changed:
            self._credit_changed.notify_all()

    def add_credit(self, frames: int) -> None:
        with self._credit_changed:
            self._credit += max(0, frames)
            self._credit_changed.notify_all()

    # --- JobSink, called by the engine in the main thread ------------------------

    def emit(self, text: str, n_tokens: int, logprobs=(), timings=None) -> None:
        with self._credit_changed:
            self._credit -= 1
        self._send(messages.Token(self.job_id, text, n_tokens, list(logprobs),
                                  timings))

    def emit_embedding(self, vector: bytes, n_tokens: int) -> None:
        with self._credit_changed:
            self._credit -= 1
        self._send(messages.Token(self.job_id, "", n_tokens, embedding=vector))

    def should_stop(self) -> bool:
        return self._cancelled.is_set()

    def wait_for_credit(self) -> bool:
        """Pause while the client is not reading; give up after the stall timeout."""
        started = time.monotonic()
        deadline = started + self._stall_timeout_s
        with self._credit_changed:
            try:
                while self._credit <= 0 and not self._cancelled.is_set():
                    if self._paused_since is None:
                        # Heartbeats say we are paused, and until when (the
                        # broker's Retry-After counts on it).
                        self._paused_since = started
                        # Not decoding until credit comes: a thread budget
                        # that came while the last token decoded is in force
                        # already (it is applied before the next decode).
                        # Set paused first, then read the budget: the link
                        # thread stores the budget, then reads ``paused``,
                        # so one of the two confirms it.
                        self._confirm_budget()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.stalled = True
                        return False
                    self._credit_changed.wait(remaining)
            finally:
                self._paused_since = None
        return not self._cancelled.is_set()

    def _confirm_budget(self) -> ThreadBudget | None:
        """Tell the broker the current thread budget is in force from the next
        decode on (it may be holding a new job until we step down:
        ``workers.broker.step_down``), once per budget."""
        budget = self._wanted_threads()
        if budget is not None and budget.seq != self._confirmed_budget:
            self._confirmed_budget = budget.seq
            self._send(messages.ThreadsSet(budget.n_threads))
        return budget

    def threads_to_use(self, current: int) -> int:
        # The engine applies the answer right after this returns, before its
        # next decode.
        budget = self._confirm_budget()
        if budget is None:
            n = current
        else:
            n, told_at = budget.n_threads, budget.told_at
            if n != current:
                # How long the host was oversubscribed (or under-used): the
                # decode that was running when THREADS arrived.
                # (tests/bench/bench_thread_stepdown.py reads this line.)
                log.debug("job %s: threads %d -> %d %s, %.1f ms after THREADS",
                          self.job_id, current, n,
                          "mid-job" if self._threads_in_use else "at its start",
                          (time.monotonic() - told_at) * 1000)
        self._threads_in_use = n  # the engine applies it before its next decode
        return n

    def report_progress(self, n_prompt, n_generated, max_tokens, tokens_per_s,
                        n_ctx_used) -> None:
        # Called for every token: keep just a tuple, replaced whole so the link
        # thread always reads a consistent set. The typed JobProgress is built
        # once per heartbeat, in progress().
        self._progress = (n_prompt, n_generated, max_tokens, tokens_per_s,
                          n_ctx_used)

    # --- called by the link thread, for heartbeats --------------------------------

    def progress(self) -> JobProgress:
        paused_since = self._paused_since
        pause_ends_in_s = None if paused_since is None else max(
            0.0, self._stall_timeout_s - (time.monotonic() - paused_since))
        return JobProgress(self.job_id, *self._progress,
                           pause_ends_in_s=pause_ends_in_s,
                           n_threads=self._threads_in_use)


class ModelWorker(LinkHandler):
    """Connects one engine to the broker."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], Engine],
        ctx: zmq.Context | None = None,
        notifier: ServiceNotifier | None = None,
    ) -> None:
        self.settings = settings
        #: CURVE keys for the link to the broker; None: plaintext.
        #: Raises ``CurveKeyError`` here, before any socket exists.
        self.curve = client_keys(settings.curve_server_key, settings.curve_secret_key)
        self._load_engine = load_engine
        #: None until the model has loaded; the link sends LOADING heartbeats
        #: until then, and READY after.
        self.engine: Engine | None = None
        self.ctx = ctx or zmq.Context.instance()
        self.name = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        # A queue.Queue, not a SimpleQueue: the main thread's timed get is
        # where SIGTERM lands, and CPython 3.11's SimpleQueue waits forever
        # if a handler returns after the deadline (tests/test_interrupted_waits.py).
        self._jobs: queue.Queue[ActiveJob] = queue.Queue()
        self.jobs_done = 0
        self._sd = notifier or SilentNotifier()
        #: What this process is doing, for whoever sees it crash.
        self._phase = worker_phase.PhaseFile(settings.phase_file)
        self.tokens_generated = 0
        self.busy = False
        #: With several brokers, the one we are registered with (one at a
        #: time: see ``broker_choice``).
        self.brokers = BrokerChoice(split_endpoints(settings.broker_endpoint),
                                    self.name)
        #: The last CACHE_REPORT built (replaced whole; read by the link
        #: thread and by metrics).
        self.cache_report: messages.CacheReport | None = None
        self._link = BrokerConnection(
            self.brokers.current, self,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            heartbeat_liveness=settings.heartbeat_liveness,
            curve=self.curve, ctx=self.ctx,
            linger_ms=500,  # let the goodbye DISCONNECT leave
            name="worker-io",
        )
        # Owned by the link thread from here on.
        #: The job the broker believes we run: set by SUBMIT, cleared when its
        #: terminal frame goes out, so that READY never overtakes that frame.
        self._job: ActiveJob | None = None
        self._registration = Registration(
            settings.heartbeat_interval_s * settings.heartbeat_liveness
        )
        self._stop: StopSignal | None = None
        self._grace_deadline: float | None = None
        #: --threads auto: the thread count the broker last gave us (read by
        #: the engine between decodes, from the main thread; replaced whole).
        #: None: fixed --threads, never changed.
        self._thread_budget: ThreadBudget | None = (
            ThreadBudget(settings.starting_threads) if settings.auto_threads
            else None)

    @property
    def malformed_dropped(self) -> int:
        """Malformed messages from the broker, dropped."""
        return self._link.malformed_dropped

    @property
    def unsent_dropped(self) -> int:
        """Messages to the broker dropped because its connection was gone."""
        return self._link.unsent_dropped

    @property
    def link_callback_errors(self) -> int:
        """Bugs caught in the link's callbacks (logged; the link went on)."""
        return self._link.callback_errors

    # --- main thread -------------------------------------------------------------

    def run(self, stop: StopSignal) -> None:
        """Serve jobs until ``stop`` is set and the current job has ended."""
        self._stop = stop
        self._link.start()
        try:
            if self.settings.held:
                # A crash loop its supervisor stopped: LOADING heartbeats
                # with the failure are all this process does.
                log.error("worker %s held: %s; not loading the model",
                          self.name, self.settings.last_failure)
                stop.wait(None)
                return
            self.engine = self._load_and_warm_up()
            self._phase.set(worker_phase.IDLE)
            while not stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._run_job(job)
                if self._jobs.empty() and not stop.is_set():
                    self._use_idle_time()
            # A job may have been handed over just before the stop.
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                job.ended_by_shutdown = True
                job.cancel()
                self._run_job(job)
        finally:
            stop.set()  # also on a failed load: the link thread says goodbye
            self._link.join(timeout_s=self.settings.heartbeat_interval_s * 3)
            self._phase.close()
            log.info("worker %s stopped after %d jobs", self.name, self.jobs_done)

    def _load_and_warm_up(self) -> Engine:
        """The engine, loaded and proven to compute (READY only after).

        Raises:
            EngineLoadError: the model did not load, or the warm-up failed
                (the worker exits with the load-failure code, and no job
                ever reached it).
        """
        self._phase.set(worker_phase.LOADING)
        try:
            engine = self._load_engine()
        except Exception as exc:
            raise EngineLoadError(str(exc)) from exc
        log.info("model loaded: %s (n_ctx=%d%s)", engine.model_name, engine.n_ctx,
                 f", weight repacking {engine.repack}" if engine.repack else "")
        self._phase.set(worker_phase.WARM_UP)
        started = time.monotonic()
        try:
            crash_if_asked(crash_on_demand.WARM_UP)
            engine.warm_up()
        except Exception as exc:
            raise EngineLoadError(f"the warm-up failed: {exc}") from exc
        log.info("warm-up done in %.0f ms", (time.monotonic() - started) * 1000)
        return engine

    def _run_job(self, job: ActiveJob) -> None:
        self.busy = True
        self._phase.set(worker_phase.job_phase(job.job_id))
        try:
            crash_if_asked(crash_on_demand.JOB)
            if job.ended_by_shutdown:
                raise RequestRejected(
                    ErrorCode.WORKER_SHUTDOWN, "the worker is shutting down"
                )
            result = self.engine.run(job.request, job)
            self.tokens_generated += result.completion_tokens
            if job.ended_by_shutdown:
                msg = messages.Error(
                    job.job_id, ErrorCode.WORKER_SHUTDOWN,
                    "the worker shut down before the job finished",
                )
            elif job.stalled:
                msg = messages.Error(
                    job.job_id, ErrorCode.CLIENT_STALLED,
                    "the client stopped reading; generation was cancelled",
                )
            else:
                msg = messages.Final(
                    job.job_id, result.finish_reason, result.usage(),
                    result.timings(), result.tail_text, result.tail_logprobs,
                    result.stopping_word,
                )
        except RequestRejected as exc:
            msg = messages.Error(job.job_id, exc.code, exc.message,
                                 exc.n_prompt_tokens, exc.n_ctx)
        except Exception:
            log.exception("job %s failed in the engine", job.job_id)
            msg = messages.Error(job.job_id, ErrorCode.ENGINE_ERROR,
                                 "generation failed")
        self.jobs_done += 1
        self.busy = False
        # Before the terminal frame: the broker frees the slot on that frame
        # and may route the next job at once, by what this report says.
        self._send_cache_report()
        self._link.send(msg)
        self._phase.set(worker_phase.IDLE)

    def _use_idle_time(self) -> None:
        """Between jobs, none waiting: let the engine do what the next job
        would otherwise do in its time to first token (save the prompt state
        it is about to move away from). A job that arrives meanwhile waits
        for that to end, no longer than it would have taken in its own time.
        The broker hears what changed, for routing and ``/slots``."""
        try:
            changed = self.engine.idle()
        except Exception:  # the worker serves on; the next job saves lazily
            log.exception("the engine's work between jobs failed")
            return
        if changed:
            self._send_cache_report()

    def _send_cache_report(self) -> None:
        """Tell the broker what the engine holds now (nothing for an engine
        without a prompt cache). Also kept for a READY to a new broker, and
        for metrics."""
        try:
            report = self.engine.prompt_cache_report()
        except Exception:  # never lose the job's terminal frame over it
            log.exception("building the prompt-cache report failed")
            return
        if report is None:
            return
        states, status = report
        self.cache_report = messages.CacheReport(states, status)
        self._link.send(self.cache_report)

    # --- the link thread (LinkHandler) -------------------------------------------

    def _ready_message(self) -> messages.Ready:
        return messages.Ready(
            worker_name=self.name,
            model=self.engine.model_name,
            n_ctx=self.engine.n_ctx,
            pid=os.getpid(),
            host=socket.gethostname(),
            engine=self.engine.name,
            pool_cores=(self.settings.host_pool_cores
                        if self.settings.auto_threads else 0),
            gpu=self.engine.gpu,
            repack=self.engine.repack,
        )

    def on_tick(self, now: float) -> None:
        stopping = self._stop.is_set()
        if (self._registration.needs_ready(now) and self._job is None
                and self.engine is not None and not stopping):
            self._link.send(self._ready_message())
            if self.cache_report is not None:
                # A new broker (or one that forgot us) learns what we hold.
                self._link.send(self.cache_report)
            self._registration.ready_sent(now)
            log.info("worker %s sent READY", self.name)
        if stopping and self._grace_deadline is None:
            self._grace_deadline = now + self.settings.shutdown_grace_s
            self._sd.stopping("draining")
            # Stop taking work before anything else.
            self._link.send(messages.Disconnect("stopping"))
        if self._grace_deadline is not None:
            if self._job is None:
                self._link.stop()
            elif now >= self._grace_deadline:
                self._job.ended_by_shutdown = True
                self._job.cancel()

    def heartbeat(self, now: float) -> messages.Message:
        self._sd.watchdog(now)
        if self.engine is None:
            return messages.Loading(self.name, self.settings.label, os.getpid(),
                                    socket.gethostname(),
                                    failure=self.settings.last_failure,
                                    held=self.settings.held)
        job = self._job
        return messages.Heartbeat(job.progress() if job is not None else None)

    def forward(self, msg: messages.Message) -> bool:
        """Whether a message the main thread queued goes to the broker.

        Two kinds come from there. A job frame goes if its job is the one
        the broker gave us and that broker is still ours (an orphaned job's
        frames would confuse a new broker). A message about the worker
        (THREADS_SET; CACHE_REPORT, made after a job or between jobs) goes
        to the broker that knows us (a new one hears the latest report after
        READY). Anything else is a bug here, and is said so, not dropped in
        silence.
        """
        job = self._job
        if isinstance(msg, messages.JOB_FRAMES):
            ours = job is not None and msg.job_id == job.job_id
            if ours and isinstance(msg, messages.TERMINAL):
                self._job = None  # READY may go out again, after this frame
            return ours and not job.orphaned
        if isinstance(msg, messages.ThreadsSet):
            return True
        if isinstance(msg, messages.CacheReport):
            return job is not None or self._registration.confirmed
        raise TypeError(f"the worker's main thread sent {type(msg).__name__}, "
                        "which forward() does not know")

    def on_message(self, msg: messages.Message) -> None:
        if not self._registration.heard(msg):
            return  # a stale DISCONNECT: see Registration
        job = self._job
        if isinstance(msg, messages.Submit):
            if job is not None:
                # The broker thinks we are idle while we are not; refuse
                # rather than queue (one slot means one job).
                self._link.send(
                    messages.Error(msg.job_id, ErrorCode.WORKER_BUSY, "slot busy")
                )
            else:
                self._job = ActiveJob(msg, self._link.send, self.settings,
                                      lambda: self._thread_budget)
                self._jobs.put(self._job)
        elif isinstance(msg, messages.Threads):
            if self._thread_budget is None:
                log.warning("broker sent THREADS %d to a fixed --threads "
                            "worker; kept %s", msg.n_threads, self.settings.n_threads)
            else:
                self._thread_budget = ThreadBudget(
                    msg.n_threads, time.monotonic(), self._thread_budget.seq + 1)
                if job is None or job.paused:
                    # Not decoding: in force at once (a paused job applies
                    # it before its next decode).
                    self._link.send(messages.ThreadsSet(msg.n_threads))
        elif isinstance(msg, messages.Cancel):
            if job is not None and job.job_id == msg.job_id:
                job.cancel()
        elif isinstance(msg, messages.Credit):
            if job is not None and job.job_id == msg.job_id:
                job.add_credit(msg.frames)
        elif isinstance(msg, messages.Disconnect):
            log.warning("broker says %r; registering again", msg.reason)
            self._registration.forget()
            self._orphan_job()
        # HEARTBEAT: hearing from the broker was the point.
        if self._registration.confirmed:
            # READY went out and the broker answered: we serve.
            self._sd.ready(f"registered with {self._link.endpoint}")

    def on_lost(self, silent_s: float) -> None:
        self._registration.forget()
        self._orphan_job()
        # The link dials ``endpoint`` next: another broker, if there is one.
        # Registration is NONE again, so on_tick sends READY on the new
        # connection; the model stays loaded.
        lost = self._link.endpoint
        self._link.endpoint = self.brokers.broker_lost()
        if self._link.endpoint != lost:
            log.warning("worker %s: broker %s silent; moving to %s",
                        self.name, lost, self._link.endpoint)

    def _orphan_job(self) -> None:
        if self._job is not None:
            self._job.orphaned = True
            self._job.cancel()
