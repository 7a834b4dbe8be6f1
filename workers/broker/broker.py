"""The broker: two ROUTER sockets and the slot ledger between them.

Frontends connect DEALERs to ``frontends_endpoint``; model workers connect
DEALERs to ``workers_endpoint``. The broker is the single authority on which
slot is free. It hands each SUBMIT to an idle worker or refuses it at once
with NO_SLOT and a Retry-After hint (admission control, no queue), relays the
job's frames back to the frontend that asked, and frees the slot when the
terminal frame passes, and at no other moment.

Flow control: both ROUTERs (``peer_sockets``) refuse a send to a gone peer
or a full pipe instead of blocking the loop or dropping a frame silently. A
worker has at most ``CREDIT_WINDOW_FRAMES`` TOKEN frames in flight per job
(the frontend grants more only as its HTTP client reads), and a real
frontend's link thread reads everything the broker sends at once, into its
own memory. So a frontend whose pipe is full is frozen or hostile (it asks
and never reads): the broker treats it as gone (cancels its jobs, forgets
it) and sends it nothing more until it registers again. A worker whose pipe
is full is treated as dead. What one peer can park in the broker is
therefore at most ``peer_sockets.SNDHWM`` messages out and ``RCVHWM`` frames
in, each at most the size limit of its kind (``protocol.limits``).

Limits (``protocol.limits``): every frame is at most ``ZMQ_MAXMSGSIZE`` (libzmq
drops a peer that sends more), every body is decoded with its command's
limits, and STATUS is answered only to registered frontends. The loop never
spends more than ``_DRAIN_BUDGET_S`` (plus one message) on one socket before
it heartbeats and expires peers, so no backlog starves the heartbeats.

On restart the ledger is empty. Workers and frontends that heartbeat an
unknown identity get DISCONNECT and register again, which rebuilds it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import zmq

from protocol import curve, limits, messages, timing, tracing
from protocol.errors import ErrorCode
from protocol.lifecycle import ServiceNotifier, SilentNotifier, StopSignal
from protocol.log_throttle import LogThrottle
from protocol.payloads import PoolStatus
from protocol.zmq_frames import recv_frames, waiting
from workers.broker import ledger as ledger_mod
from workers.broker.admission import SubmitAdmission
from workers.broker.cache_claims import ClaimChecks
from workers.broker.counters import BrokerCounters
from workers.broker.expiry import MuteJobs, StuckCancels, StuckFrontends
from workers.broker.job_relay import JobRelay
from workers.broker.key_limits import KeyAccounts
from workers.broker.metrics import LatestSnapshotCollector
from workers.broker.peer_sockets import PeerSockets
from workers.broker.pool_stats import PoolStats
from workers.broker.registration import WorkerRegistration
from workers.broker.revocation import KeyRevocation
from workers.broker.security import BrokerSecurity
from workers.broker.settings import BrokerSettings
from workers.broker.slot_actions import SlotActions
from workers.broker.step_down import ThreadStepDown
from workers.broker.waiting_room import WaitingJobs

log = logging.getLogger("llamapool.broker")

#: Messages handled per socket per poll round, so one busy side cannot
#: starve the other or the heartbeat timer.
_BATCH = 256
#: Time one socket's drain may take per round (checked between messages, so
#: a round can overrun by one message: at most ~0.1 s for the largest
#: SUBMIT). Far below any liveness window, so heartbeats keep their pace
#: whatever a peer floods us with.
_DRAIN_BUDGET_S = 0.05
class Broker:
    """Routes jobs between frontends and workers. Single-threaded.

    Its policies live in modules of their own and hear the broker's events
    by name (``on_beat``, ``on_assign``, ``on_finish``, ``on_worker_gone``):
    CURVE keys revoked after the handshake (``revocation``), the undecoded
    TOKEN relay and its repair (``job_relay``), ``--threads auto``'s
    step-down (``step_down``), jobs nobody starts and frontends that never
    read (``expiry``). What is left here is the loop, the dispatch of each
    command to its handler, and the ledger's own transitions.
    """

    def __init__(self, settings: BrokerSettings, ctx: zmq.Context | None = None,
                 metrics: LatestSnapshotCollector | None = None,
                 notifier: ServiceNotifier | None = None):
        self.settings = settings
        self.metrics = metrics
        self.ctx = ctx or zmq.Context.instance()
        self.ledger = ledger_mod.Ledger(
            settings.heartbeat_interval_s * settings.heartbeat_liveness,
            prefer_prefix=settings.routing == "prefix",
        )
        self.counters = BrokerCounters()
        self.stats = PoolStats()
        #: Peer-driven log lines (registrations, losses) at a bounded rate.
        self.log = LogThrottle(log)
        self._sd = notifier or SilentNotifier()
        self.security = BrokerSecurity(
            settings.curve_secret_key, settings.curve_authorized_workers,
            settings.curve_authorized_frontends, settings.insecure_plaintext,
            on_refused=self.counters.curve_refusal,  # from the ZAP thread
        )
        self.sockets = PeerSockets(settings, self.ctx, self.security, self.counters,
                                   on_stuck_frontend=self._stuck_frontend)
        self.registration = WorkerRegistration(self)
        #: SUBMIT: a slot of the job's model, or why not (``admission``).
        self.admission = SubmitAdmission(self)
        self.keys = KeyRevocation(self)
        self.relay = JobRelay(self)
        self.slot_actions = SlotActions(self)  # llama-server's slot files
        self.step_down = ThreadStepDown(self)
        self.stuck_frontends = StuckFrontends(self)
        self.claim_checks = ClaimChecks(self)
        #: Jobs that wait for a slot (``--queue-max``; off: NO_SLOT at once).
        self.waiting = WaitingJobs(self)
        #: Named keys' limits and usage (``key_limits``).
        self.key_accounts = KeyAccounts()
        #: Spans of traced jobs (``job_traces``); None: tracing is off, and
        #: OpenTelemetry is not even imported.
        self.traces = None
        if tracing.TRACER is not None:
            from workers.broker.job_traces import BrokerTraces
            self.traces = BrokerTraces(self)
        #: Heard at every heartbeat, in this order, after the ledger's
        #: liveness expiry.
        self._on_beat: list[Callable[[float], None]] = [
            MuteJobs(self).on_beat, StuckCancels(self).on_beat,
            self.step_down.on_beat]
        self._frontend_handlers: dict[type, Callable] = {
            messages.Status: self._on_status,
            messages.Cancel: self._on_cancel_message,
            messages.Credit: self._on_credit,
            messages.SlotAction: self.slot_actions.on_action,
            messages.Heartbeat: lambda ident, msg, raw, now: None,
        }
        self._worker_handlers: dict[type, Callable] = {
            messages.CacheReport: self._on_cache_report,
            messages.Heartbeat: self._on_worker_heartbeat,
            messages.ThreadsSet: self._on_threads_set,
            messages.Disconnect: self._on_worker_goodbye,
            messages.SlotDone: self.slot_actions.on_done,
            **dict.fromkeys(messages.JOB_FRAMES, self._on_job_frame),
        }

    def bind(self) -> None:
        self.sockets.bind()
        self.keys.refresh()
        log.info("broker listening: frontends=%s workers=%s",
                 self.settings.frontends_endpoint, self.settings.workers_endpoint)

    def close(self) -> None:
        self.sockets.close()

    def to_frontend(self, identity: bytes, msg_or_frames) -> bool:
        """A message (or its frames, relayed as they came) to one frontend;
        False if it is gone or does not read (``PeerSockets.send``)."""
        return self.sockets.send(self.sockets.frontends, identity, msg_or_frames)

    def to_worker(self, identity: bytes, msg_or_frames) -> bool:
        """A message (or its frames, relayed as they came) to one worker."""
        return self.sockets.send(self.sockets.workers, identity, msg_or_frames)

    # --- main loop ---------------------------------------------------------------

    def run(self, stop: StopSignal) -> None:
        """Serve until ``stop`` is set."""
        if self.sockets.frontends is None:
            self.bind()
        self._sd.ready("broker listening")
        poller = zmq.Poller()
        poller.register(self.sockets.frontends, zmq.POLLIN)
        poller.register(self.sockets.workers, zmq.POLLIN)
        interval_s = self.settings.heartbeat_interval_s
        next_beat = time.monotonic()
        try:
            while not stop.is_set():
                wake_at = min(next_beat, self.step_down.next_deadline() or next_beat,
                              self.waiting.next_deadline() or next_beat)
                timeout_ms = max(0.0, wake_at - time.monotonic()) * 1000
                ready = dict(poller.poll(min(timeout_ms, interval_s * 1000)))
                if self.sockets.workers in ready:
                    self._read_workers()
                if self.sockets.frontends in ready:
                    self._drain(self.sockets.frontends, curve.FRONTENDS,
                                self._on_frontend_frames,
                                self._malformed_from_frontend)
                self.stuck_frontends.drop()
                now = time.monotonic()
                if self.waiting.room.waiters:
                    self.waiting.serve(now)
                if self.step_down:
                    self.step_down.on_due(now)
                if now >= next_beat:
                    self._heartbeat_and_expire(now)
                    self._sd.watchdog(now)
                    next_beat = now + interval_s
        finally:
            self._sd.stopping()
            self.close()
            log.info("broker stopped")

    def _read_workers(self) -> None:
        self._drain(self.sockets.workers, curve.WORKERS, self._on_worker_frames,
                    self.relay.on_malformed_from_worker)

    def _drain(self, sock: zmq.Socket, role: str, handle, malformed) -> None:
        deadline = time.monotonic() + min(
            _DRAIN_BUDGET_S, self.settings.heartbeat_interval_s / 4)
        for n in range(_BATCH):
            # Mostly one message per poll round: ask before a second receive
            # rather than build the exception of an empty one. Under a flood
            # the receives' own ``zmq.Again`` ends the batch.
            if n == 1 and not waiting(sock):
                return
            if time.monotonic() > deadline:
                self.counters.drain_budget_spent += 1
                return
            try:
                if self.keys.allowed is None:
                    frames = recv_frames(sock)
                else:
                    frames = self.keys.recv(sock, role)
            except zmq.Again:
                return
            if frames is None:
                continue
            if len(frames) < 2:
                self.malformed(b"?", "no routing identity")
                continue
            identity, body = frames[0], frames[1:]
            if sock is self.sockets.workers and self._relay_token(identity, body):
                continue
            try:
                msg = messages.decode(body)
            except messages.MalformedMessage as exc:
                malformed(identity, str(exc), body)
                continue
            handle(identity, msg, body)

    def _relay_token(self, identity: bytes, body: list[bytes]) -> bool:
        """A TOKEN of the job its worker holds, relayed undecoded
        (``workers.broker.job_relay``); False for any other frame."""
        return self.relay.relay_token(identity, body, time.monotonic())

    def _stuck_frontend(self, identity: bytes) -> None:
        self.stuck_frontends.found.add(identity)

    def malformed(self, identity: bytes, why: str, frames=None) -> None:
        """Drop and count a message that does not decode."""
        self.counters.malformed_dropped += 1
        # Rate-limited: a garbage flood must not become a log flood.
        self.log.warning(
            "malformed", "dropped malformed message #%d from %s: %s",
            self.counters.malformed_dropped, identity[:16].hex(), why[:200],
        )

    def _malformed_from_frontend(self, identity: bytes, why: str,
                                 frames: list[bytes]) -> None:
        """Drop and count; and answer a SUBMIT that names its job with
        ERROR, so its frontend fails the request now instead of after its
        submit timeout. A frontend of this version never sends one (its
        SUBMIT is checked by the same decoder): a peer of another version
        (a chat role this one does not know), or one that lies."""
        self.malformed(identity, why)
        job_id = messages.claimed_job_id(frames, (messages.Submit,))
        if job_id is None:
            return
        self.counters.unreadable_submits += 1
        self.to_frontend(identity, messages.Error(
            job_id, ErrorCode.UNREADABLE_JOB,
            f"the broker could not read the job: {why}"[:limits.MAX_REASON_CHARS]))

    def _violation(self, side: str, send, ident: bytes, msg) -> None:
        """A known peer sent a command it should not: DISCONNECT."""
        self.counters.protocol_violation += 1
        self.log.warning(f"{side} violation", f"{side} sent %s; disconnecting it",
                         type(msg).__name__)
        send(ident, messages.Disconnect("unexpected command"))

    # --- frontend side -----------------------------------------------------------

    def _on_frontend_frames(self, ident: bytes, msg: messages.Message, raw) -> None:
        now = time.monotonic()
        known = self.ledger.touch_frontend(ident, now)
        if isinstance(msg, messages.Hello):
            self.ledger.register_frontend(ident, now, msg.pid, msg.host)
            self.log.info("frontend registered",
                          "frontend registered: pid=%d host=%s", msg.pid, msg.host)
            return
        if not known:
            self.counters.unknown_peer += 1
            self.to_frontend(ident, messages.Disconnect("unknown frontend"))
            if not isinstance(msg, (messages.Submit, messages.SlotAction)):
                # STATUS too: a reply is the one large thing the broker
                # sends, so only a registered frontend (whose pipe we watch,
                # ``expiry.StuckFrontends``) gets one. A frontend re-sends its
                # pending STATUS after it registers again.
                return
            # A SUBMIT is served (refusing the first request after a broker
            # restart helps nobody), after the DISCONNECT: this frontend may
            # still wait on jobs a previous broker accepted, and must fail
            # them. Frames are ordered, so the DISCONNECT arrives before this
            # job's ACCEPTED, and the frontend fails only jobs accepted
            # before it.
            self.ledger.register_frontend(ident, now)
        if isinstance(msg, messages.Submit):
            self.admission.on_submit(ident, msg, raw, now)
            if self.traces is not None and msg.trace is not None:
                self.traces.on_submit(ident, msg, now)
            return
        handler = self._frontend_handlers.get(type(msg))
        if handler is None:
            self._violation("frontend", self.to_frontend, ident, msg)
        else:
            handler(ident, msg, raw, now)

    def _on_status(self, ident: bytes, msg: messages.Status, raw, now: float) -> None:
        self.counters.status_requests += 1
        self.to_frontend(ident, messages.StatusReply(msg.request_id,
                                                     self.snapshot(now)))

    def _on_cancel_message(self, ident: bytes, msg: messages.Cancel, raw,
                           now: float) -> None:
        if msg.broken:
            self.relay.on_broken_job(ident, msg.job_id, msg.broken)
        else:
            self.cancel(ident, msg.job_id, now)

    def _on_credit(self, ident: bytes, msg: messages.Credit, raw, now: float) -> None:
        job = self.ledger.jobs.get(msg.job_id)
        if job is not None and job.frontend == ident:
            self.to_worker(job.worker, raw)

    def start_job(self, ident: bytes, msg: messages.Submit, raw: list[bytes],
                  slot: ledger_mod.WorkerSlot, now: float) -> None:
        """A job that got ``slot`` (at once, or after waiting): to its worker,
        and ACCEPTED to its frontend."""
        self.waiting.on_start(msg, now)
        if slot.shared_blocks_at_assign:
            self.counters.routed_by_prefix += 1
        job = self.ledger.jobs[msg.job_id]
        job.request_id, job.key = msg.request_id, msg.key
        self.claim_checks.on_assign(job, msg)
        if (not self.step_down.on_assign(msg.job_id, slot.identity, raw, now)
                and not self.to_worker(slot.identity, raw)):
            # The worker vanished between its last beat and now.
            self.worker_died(slot.identity, "unreachable")
            self.to_frontend(
                ident, messages.NoSlot(msg.job_id, timing.RETRY_AFTER_MIN_S))
            return
        self.to_frontend(
            ident, messages.Accepted(msg.job_id, slot.slot_id, slot.info.model,
                                     slot.info.defaults))

    def cancel(self, frontend: bytes, job_id: str, now: float) -> None:
        """The job's frontend asks to cancel it (or is gone)."""
        if self.waiting.cancel(frontend, job_id):
            return  # it was waiting: gone, and nothing ran for it
        job = self.ledger.jobs.get(job_id)
        if job is None or job.frontend != frontend:
            return  # already finished: the terminal frame crossed the cancel
        self._cancel_job(job, now)

    def _cancel_job(self, job: ledger_mod.Job, now: float) -> None:
        if self.ledger.request_cancel(job.job_id, now) is not None:
            # A held SUBMIT goes first: the worker then ends the job itself,
            # with the terminal frame that frees the slot.
            self.step_down.release(job.job_id)
            self.to_worker(job.worker, messages.Cancel(job.job_id))
            if self.traces is not None:
                self.traces.on_cancel(job, now)

    # --- worker side -------------------------------------------------------------

    def _on_worker_frames(self, ident: bytes, msg: messages.Message, raw) -> None:
        now = time.monotonic()
        if isinstance(msg, messages.Loading):
            self.registration.on_loading(ident, msg, now)
            return
        if isinstance(msg, messages.Ready):
            self.registration.on_ready(ident, msg, now)
            return
        slot = self.ledger.touch_worker(ident, now)
        if slot is None:
            self.counters.unknown_peer += 1
            self.to_worker(ident, messages.Disconnect("unknown worker"))
            return
        handler = self._worker_handlers.get(type(msg))
        if handler is None:
            self._violation("worker", self.to_worker, ident, msg)
        else:
            handler(slot, msg, raw, now)

    def _on_cache_report(self, slot, msg: messages.CacheReport, raw, now) -> None:
        self.ledger.record_cache_report(slot, msg)

    def _on_worker_heartbeat(self, slot, msg: messages.Heartbeat, raw, now) -> None:
        progress = msg.progress
        if progress is not None and slot.job_id and progress.job_id == slot.job_id:
            self.ledger.record_progress(slot, progress, now)
            self.ledger.job_heard(slot.job_id)

    def _on_threads_set(self, slot, msg: messages.ThreadsSet, raw, now) -> None:
        self.step_down.stepped_down(slot.identity, msg.n_threads, msg.seq)

    def _on_worker_goodbye(self, slot, msg: messages.Disconnect, raw, now) -> None:
        # The worker is shutting down: no new jobs. Its current job (if any)
        # still ends with a terminal frame, which frees the slot.
        self.log.info("worker leaving", "worker leaving (%s): slot=%d pid=%d",
                      msg.reason[:200], slot.slot_id, slot.info.pid)
        slot.draining = True
        if slot.job_id is None:
            self.ledger.remove_worker(slot.identity)

    def _on_job_frame(self, slot, msg, raw, now: float) -> None:
        if msg.job_id != slot.job_id:
            self.counters.stale_frames += 1
            return
        job = self.ledger.jobs[msg.job_id]
        if isinstance(msg, messages.TERMINAL):
            job.heard = True
            self.to_frontend(job.frontend, raw)
            self._finish(job, msg, now)
        else:
            self.relay.relay(job, raw, now)

    def _finish(self, job: ledger_mod.Job, msg: messages.Message, now: float) -> None:
        self.ledger.finish(job.job_id, now)
        self.waiting.on_end(job.job_id, msg, now)
        self.stats.job_ended(msg, job.cancel_requested_at, now, job.model)
        slot = self.ledger.workers.get(job.worker)
        self.claim_checks.on_finish(slot, job, msg)
        if slot is not None and slot.draining:
            self.ledger.remove_worker(job.worker)
        self.counters.finished += 1
        self.step_down.on_finish(job.worker)
        if self.traces is not None:
            self.traces.on_finish(job, msg)

    def fail_job(self, job: ledger_mod.Job, code: ErrorCode, message: str) -> None:
        """End a job the broker can no longer run: ERROR to its frontend."""
        self.counters.job_failed(code)
        self.to_frontend(job.frontend, messages.Error(job.job_id, code, message))
        if self.traces is not None:
            self.traces.on_failed(job, str(code))

    def worker_died(self, ident: bytes, why: str, *,
                    code: ErrorCode = ErrorCode.WORKER_DIED,
                    message: str = "the model worker died mid-job") -> None:
        """Forget a worker that is gone (or that the broker gives up on); its
        job fails with ``code``, and the log line names the job, its request
        and its key, so a worker that dies on every job can be traced to
        the requests that kill it."""
        slot = self.ledger.workers.get(ident)
        orphan = self.ledger.remove_worker(ident)
        self.counters.worker_deaths += 1
        self.step_down.on_worker_gone(ident)
        if slot is not None:
            self.registration.on_worker_gone(slot.info.host)
            if orphan is None:
                self.log.warning(
                    "worker lost", "worker lost (%s): slot=%d pid=%d host=%s",
                    why, slot.slot_id, slot.info.pid, slot.info.host)
            else:
                # Its own key: a flood of idle fakes coming and going must
                # not hold back the lines that name jobs.
                self.log.warning(
                    "worker lost mid-job", "worker lost (%s) during %s: slot=%d "
                    "pid=%d host=%s; the job fails with %s", why, orphan.named(),
                    slot.slot_id, slot.info.pid, slot.info.host, code)
        if orphan is not None:
            self.stats.job_lost(orphan.model)
            self.waiting.on_end(orphan.job_id, None, time.monotonic())
            self.fail_job(orphan, code, message)

    # --- liveness ----------------------------------------------------------------

    def frontend_gone(self, ident: bytes, now: float) -> None:
        """Forget a frontend and cancel the jobs it held (or left waiting)."""
        self.waiting.frontend_gone(ident)
        for job in self.ledger.remove_frontend(ident):
            self._cancel_job(job, now)

    def _heartbeat_and_expire(self, now: float) -> None:
        self.keys.on_beat(now)
        dead_workers, dead_frontends = self.ledger.expired(now)
        for ident in dead_workers:
            self.worker_died(ident, "heartbeat timeout")
        for ident in dead_frontends:
            self.counters.frontend_deaths += 1
            self.log.warning("frontend lost", "frontend lost (heartbeat timeout): %s",
                             ident[:16].hex())
            self.frontend_gone(ident, now)
        for on_beat in self._on_beat:
            on_beat(now)
        if self.metrics is not None:
            self.metrics.publish(self.snapshot(now))
        beat = messages.Heartbeat().to_wire()
        unreachable = [ident for ident in list(self.ledger.workers)
                       if not self.to_worker(ident, beat)]
        if unreachable:
            # A worker that said goodbye and closed its socket is unreachable
            # before this loop has read the DISCONNECT queued behind the
            # closed pipe: read it first, so a goodbye is not a death.
            self._read_workers()
            for ident in unreachable:
                if ident in self.ledger.workers:
                    self.worker_died(ident, "unreachable")
        for ident in list(self.ledger.frontends):
            self.to_frontend(ident, beat)
        self.stuck_frontends.drop()

    def snapshot(self, now: float) -> PoolStatus:
        snap = self.ledger.snapshot(now, self.counters.as_dict(), self.stats.totals())
        return dataclasses.replace(snap, jobs_waiting=len(self.waiting.room),
                                   models=self.waiting.with_waiting(snap.models),
                                   keys=self.key_accounts.usage(),
                                   retry_after_s=self.waiting.retry_after_s(now))
