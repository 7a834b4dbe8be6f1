"""The model worker's link side: what the broker knows of us.

``WorkerLink`` is the ``LinkHandler`` of the worker's ``BrokerConnection``;
every method runs in the connection's thread, which owns the DEALER. It
keeps registration (READY, and again after DISCONNECT or a silent broker),
the job the broker believes we run, the thread budget (``--threads auto``),
the move to another broker and the shutdown grace. It hands each SUBMIT to
the ``JobRunner`` and forwards what the runner sends back, each message
tagged with its job (``Outgoing``).

Two things only this thread can do, because the main thread may be stuck in
one native call (a decode that never returns: issue 29's exploding grammar)
where no Python code runs and SIGTERM is never seen:

* the cancel deadline: a job told to cancel (by the broker, by the broker's
  loss, or by the end of the shutdown grace) that has not ended within
  ``--cancel-timeout-s`` is stuck, and the link ends the whole process
  (``os._exit(CANCEL_TIMEOUT_EXIT)``, which takes the stuck thread with it),
  for ``llamapool up`` or systemd to start a fresh one;
* a SUBMIT that does not decode (a broker of another version, or one that
  lies) is answered with ERROR ``unreadable_job`` when its job id can be
  read, so the broker does not wait out its first-frame deadline.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import time

import zmq

from protocol import limits, messages
from protocol.curve import ClientKeys
from protocol.errors import ErrorCode
from protocol.lifecycle import ServiceNotifier, StopSignal
from protocol.link import BrokerConnection, LinkHandler
from protocol.log_throttle import LogThrottle
from protocol.worker_phase import CANCEL_TIMEOUT_EXIT
from workers.model.active_job import ActiveJob, Outgoing, ThreadBudget
from workers.model.broker_choice import BrokerChoice
from workers.model.capabilities import engine_capabilities
from workers.model.job_runner import JobRunner
from workers.model.settings import WorkerSettings
from workers.model.slot_files import NOT_SUPPORTED, SlotTask

log = logging.getLogger("llamapool.worker")

#: The frames of what the broker gave us (a job, or a slot action), and
#: those that end it.
_TERMINAL = (*messages.TERMINAL, messages.SlotDone)
_JOB_FRAMES = (*messages.JOB_FRAMES, messages.SlotDone)


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


class WorkerLink(LinkHandler):
    """The worker's side of its broker connection (the link thread)."""

    def __init__(
        self,
        settings: WorkerSettings,
        name: str,
        brokers: BrokerChoice,
        runner: JobRunner,
        notifier: ServiceNotifier,
        *,
        curve: ClientKeys | None,
        ctx: zmq.Context,
    ) -> None:
        self.settings = settings
        self.name = name
        #: With several brokers, the one we are registered with (one at a
        #: time: see ``broker_choice``).
        self.brokers = brokers
        self._runner = runner
        self._sd = notifier
        self.connection = BrokerConnection(
            brokers.current, self,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            heartbeat_liveness=settings.heartbeat_liveness,
            curve=curve, ctx=ctx,
            linger_ms=500,  # let the goodbye DISCONNECT leave
            name="worker-io",
        )
        # Owned by the link thread from here on.
        #: The job the broker believes we run: set by SUBMIT, cleared when its
        #: terminal frame goes out, so that READY never overtakes that frame.
        self._job: ActiveJob | None = None
        #: When the current job was first told to cancel (monotonic); None
        #: while it was not. Its deadline: ``settings.cancel_timeout_s``.
        self._cancelled_at: float | None = None
        #: Lines a broker's messages cause, at a bounded rate.
        self._log = LogThrottle(log)
        self._registration = Registration(
            settings.heartbeat_interval_s * settings.heartbeat_liveness
        )
        self._stop: StopSignal | None = None
        self._grace_deadline: float | None = None
        #: When the link thread last beat (monotonic; None: not yet): its
        #: age on ``/metrics`` says the thread still turns
        #: (``llamapool probe worker``).
        self.last_beat_at: float | None = None
        #: --threads auto: the thread count the broker last gave us (read by
        #: the engine between decodes, from the main thread; replaced whole).
        #: None: fixed --threads, never changed.
        self._thread_budget: ThreadBudget | None = (
            ThreadBudget(settings.starting_threads) if settings.auto_threads
            else None)

    # --- the main thread ---------------------------------------------------------

    def start(self, stop: StopSignal) -> None:
        """Start the link thread; it says goodbye and ends once ``stop`` is
        set and the current job has ended (or the grace has run out)."""
        self._stop = stop
        self.connection.start()

    def send(self, out: Outgoing) -> None:
        """Queue what the main thread says; ``forward`` decides, in the link
        thread, whether it goes out."""
        self.connection.send(out, out.message.to_wire())

    # --- the link thread (LinkHandler) -------------------------------------------

    def _ready_message(self) -> messages.Ready:
        engine = self._runner.engine
        return messages.Ready(
            worker_name=self.name,
            model=engine.model_name,
            n_ctx=engine.n_ctx,
            pid=os.getpid(),
            host=socket.gethostname(),
            engine=engine.name,
            pool_cores=(self.settings.host_pool_cores
                        if self.settings.auto_threads else 0),
            gpu=engine.gpu,
            repack=engine.repack,
            aliases=self.settings.alias_list,
            capabilities=engine_capabilities(engine),
            defaults=self.settings.request_defaults,
        )

    def on_tick(self, now: float) -> None:
        stopping = self._stop.is_set()
        if (self._registration.needs_ready(now) and self._job is None
                and self._runner.engine is not None and not stopping):
            self.connection.send(self._ready_message())
            cache_report = self._runner.cache_report
            if cache_report is not None:
                # A new broker (or one that forgot us) learns what we hold.
                self.connection.send(cache_report)
            self._registration.ready_sent(now)
            log.info("worker %s sent READY", self.name)
        if stopping and self._grace_deadline is None:
            self._grace_deadline = now + self.settings.shutdown_grace_s
            self._sd.stopping("draining")
            # Stop taking work before anything else.
            self.connection.send(messages.Disconnect("stopping"))
        if self._grace_deadline is not None:
            if self._job is None:
                self.connection.stop()
            elif now >= self._grace_deadline:
                self._job.ended_by_shutdown = True
                self._cancel_job()
        self._end_if_stuck(now)

    def _cancel_job(self) -> None:
        """Tell the current job to stop; its cancel deadline starts now, the
        first time."""
        self._job.cancel()
        if self._cancelled_at is None:
            self._cancelled_at = time.monotonic()

    def _end_if_stuck(self, now: float) -> None:
        """End the process if the current job was told to cancel more than
        ``cancel_timeout_s`` ago. A job checks its cancel at every token, so
        it is stuck in one native call, where SIGTERM never reaches Python
        either; ``os._exit`` ends every thread, that one too."""
        if (self._job is None or self._cancelled_at is None
                or now - self._cancelled_at < self.settings.cancel_timeout_s):
            return
        log.critical(
            "job %s was told to cancel %.1fs ago and has not ended: its thread "
            "is stuck in native code (--cancel-timeout-s %.1f); ending this "
            "worker process (exit %d) so that a fresh one takes its place",
            self._job.job_id, now - self._cancelled_at,
            self.settings.cancel_timeout_s, CANCEL_TIMEOUT_EXIT)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(CANCEL_TIMEOUT_EXIT)

    @property
    def registered(self) -> bool:
        """Whether the broker has answered our READY and not forgotten us."""
        return self._registration.confirmed

    def heartbeat(self, now: float) -> messages.Message:
        self._sd.watchdog(now)
        self.last_beat_at = now
        if self._runner.engine is None:
            return messages.Loading(self.name, self.settings.label, os.getpid(),
                                    socket.gethostname(),
                                    failure=self.settings.last_failure,
                                    held=self.settings.held,
                                    aliases=self.settings.alias_list)
        job = self._job
        return messages.Heartbeat(job.progress() if job is not None else None)

    def forward(self, out: Outgoing) -> bool:
        """Whether a message the main thread queued goes to the broker.

        A job's frame goes if its job is the one the broker gave us and
        that broker is still ours (an orphaned job's frames would confuse a
        new broker); a frame of any earlier job is dropped. A message about
        the worker goes by its own rule: THREADS_SET always (the broker
        holds a job for it); CACHE_REPORT (made after a job or between
        jobs) to the broker that knows us (a new one hears the latest
        report after READY). Anything else is a bug here, and is said so,
        not dropped in silence.
        """
        if not isinstance(out, Outgoing):
            raise TypeError(f"the worker's main thread sent a bare "
                            f"{type(out).__name__}, not an Outgoing")
        msg, job = out.message, out.job
        if isinstance(msg, _JOB_FRAMES) and job is not None:
            current = job is self._job
            if current and isinstance(msg, _TERMINAL):
                self._job = None  # READY may go out again, after this frame
                self._cancelled_at = None
            return current and not job.orphaned
        if isinstance(msg, messages.ThreadsSet):
            return True
        if isinstance(msg, messages.CacheReport):
            return self._job is not None or self._registration.confirmed
        raise TypeError(f"the worker's main thread sent {type(msg).__name__} "
                        f"(job {job.job_id if job else None}), which forward() "
                        "does not know")

    def on_message(self, msg: messages.Message) -> None:
        if not self._registration.heard(msg):
            return  # a stale DISCONNECT: see Registration
        job = self._job
        if isinstance(msg, messages.Submit):
            self._on_submit(msg)
        elif isinstance(msg, messages.SlotAction):
            self._on_slot_action(msg)
        elif isinstance(msg, messages.Threads):
            self._on_threads(msg)
        elif isinstance(msg, messages.Cancel):
            if job is not None and job.job_id == msg.job_id:
                self._cancel_job()
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
            self._sd.ready(f"registered with {self.connection.endpoint}")

    def _on_submit(self, msg: messages.Submit) -> None:
        if self._job is not None:
            # The broker thinks we are idle while we are not; refuse rather
            # than queue (one slot means one job).
            self.connection.send(
                messages.Error(msg.job_id, ErrorCode.WORKER_BUSY, "slot busy"))
            return

        def send(frame: messages.Message) -> None:
            # Each frame the job sends is tagged with the job itself (bound
            # below, before the runner sees the job).
            self.send(Outgoing(job, frame))

        job = ActiveJob(msg, send, self.settings, lambda: self._thread_budget)
        self._job = job
        self._cancelled_at = None
        self._runner.submit(job)

    def _on_slot_action(self, msg: messages.SlotAction) -> None:
        """A slot action is the slot's job while it runs (the broker leased
        the slot for it): refused when one runs, or when the runner has no
        slot actions (a batched worker's), with a SLOT_DONE that says so."""
        run = getattr(self._runner, "submit_slot_action", None)
        refusal = ((ErrorCode.WORKER_BUSY, "slot busy") if self._job is not None
                   else (ErrorCode.SLOT_ACTIONS_UNSUPPORTED, NOT_SUPPORTED)
                   if run is None else None)
        if refusal is not None:
            self.connection.send(messages.SlotDone(
                msg.job_id, msg.action, code=refusal[0], message=refusal[1]))
            return
        task = SlotTask(msg)
        self._job = task
        self._cancelled_at = None
        run(task)

    def on_malformed(self, error: messages.MalformedMessage,
                     frames: list[bytes]) -> None:
        """A SUBMIT we cannot decode (an unknown chat role from a broker of
        a newer version, an 8 MB body from one that lies) still names its
        job: answer ERROR, so the broker frees the slot and tells the
        client at once instead of after its first-frame deadline."""
        job_id = messages.claimed_job_id(frames, (messages.Submit,))
        if job_id is None:
            return  # nothing names the job: dropped (and counted by the link)
        self._log.warning(
            "unreadable submit", "the SUBMIT of job %s does not decode (%s); "
            "answered ERROR", job_id[:limits.MAX_ID_CHARS], str(error)[:200])
        self.connection.send(messages.Error(
            job_id, ErrorCode.UNREADABLE_JOB,
            f"the model worker could not read the job: {error}"[
                :limits.MAX_REASON_CHARS]))

    def _on_threads(self, msg: messages.Threads) -> None:
        if self._thread_budget is None:
            log.warning("broker sent THREADS %d to a fixed --threads "
                        "worker; kept %s", msg.n_threads, self.settings.n_threads)
            return
        self._thread_budget = ThreadBudget(
            msg.n_threads, time.monotonic(), self._thread_budget.seq + 1, msg.seq)
        job = self._job
        if job is None or job.in_force_at_once(msg.n_threads):
            # Not decoding, paused, or decoding with no more threads than
            # this: ``ActiveJob.in_force_at_once``. The decode loop may
            # confirm it again when it takes it; the broker counts only an
            # answer to its latest THREADS (``seq``).
            self.connection.send(messages.ThreadsSet(msg.n_threads, msg.seq))

    def on_lost(self, silent_s: float) -> None:
        self._registration.forget()
        self._orphan_job()
        # The link dials ``endpoint`` next: another broker, if there is one.
        # Registration is NONE again, so on_tick sends READY on the new
        # connection; the model stays loaded.
        lost = self.connection.endpoint
        self.connection.endpoint = self.brokers.broker_lost()
        if self.connection.endpoint != lost:
            log.warning("worker %s: broker %s silent; moving to %s",
                        self.name, lost, self.connection.endpoint)

    def _orphan_job(self) -> None:
        if self._job is not None:
            self._job.orphaned = True
            self._cancel_job()
