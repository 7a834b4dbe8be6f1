"""The broker: two ROUTER sockets and the slot ledger between them.

Frontends connect DEALERs to ``frontends_endpoint``; model workers connect
DEALERs to ``workers_endpoint``. The broker is the single authority on which
slot is free. It hands each SUBMIT to an idle worker or refuses it at once
with NO_SLOT and a Retry-After hint (admission control, no queue), relays the
job's frames back to the frontend that asked, and frees the slot when the
terminal frame passes, and at no other moment.

Flow control: both ROUTERs set ``ROUTER_MANDATORY`` so that a send to a gone
peer raises instead of vanishing, and a send to a full pipe raises EAGAIN
instead of blocking the loop or dropping a frame silently (``_SNDHWM``).
A worker has at most ``CREDIT_WINDOW_FRAMES`` TOKEN frames in flight per job
(the frontend grants more only as its HTTP client reads), and a real
frontend's link thread reads everything the broker sends at once, into its
own memory. So a frontend whose pipe is full is frozen or hostile (it asks
and never reads): the broker treats it as gone (cancels its jobs, forgets
it) and sends it nothing more until it registers again. A worker whose pipe
is full is treated as dead. What one peer can park in the broker is
therefore at most ``_SNDHWM`` messages out and ``_RCVHWM`` frames in, each
at most the size limit of its kind (``protocol.limits``).

Limits (``protocol.limits``): every frame is at most ``ZMQ_MAXMSGSIZE`` (libzmq
drops a peer that sends more), every body is decoded with its command's
limits, and STATUS is answered only to registered frontends. The loop never
spends more than ``_DRAIN_BUDGET_S`` (plus one message) on one socket before
it heartbeats and expires peers, so no backlog starves the heartbeats.

On restart the ledger is empty. Workers and frontends that heartbeat an
unknown identity get DISCONNECT and register again, which rebuilds it.
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from protocol import curve, limits, messages, timing
from protocol.errors import ErrorCode
from protocol.lifecycle import ServiceNotifier, SilentNotifier, StopSignal
from protocol.log_throttle import LogThrottle
from protocol.payloads import PoolStatus
from protocol.prefix import MAX_BLOCKS
from protocol.zmq_frames import recv_frames, send_frames, waiting
from workers.broker import ledger as ledger_mod
from workers.broker.metrics import LatestSnapshotCollector
from workers.broker.pool_stats import PoolStats
from workers.broker.restarts import HostDeaths
from workers.broker.security import BrokerSecurity
from workers.broker.settings import BrokerSettings
from workers.broker.step_down import HeldSubmit, HeldSubmits
from workers.broker.thread_budget import budgets

log = logging.getLogger("llamapool.broker")

#: Messages handled per socket per poll round, so one busy side cannot
#: starve the other or the heartbeat timer.
_BATCH = 256
#: Time one socket's drain may take per round (checked between messages, so
#: a round can overrun by one message: at most ~0.1 s for the largest
#: SUBMIT). Far below any liveness window, so heartbeats keep their pace
#: whatever a peer floods us with.
_DRAIN_BUDGET_S = 0.05
#: Messages queued per peer towards it. A live peer reads at once; this is
#: room for bursts (a frontend streaming many jobs' TOKEN frames while its
#: process is descheduled), not a buffer anyone should fill.
_SNDHWM = 10_000
#: Frames queued per peer towards us. Small: a peer that sends faster than
#: we read waits (back-pressure: its own DEALER keeps the rest, nothing is
#: dropped), and a flood of maximal frames parks at most this many of them
#: here (32 x 2 MiB). The price: a peer that closes its socket with a short
#: linger right after a burst may lose the tail of the burst.
_RCVHWM = 32


class Broker:
    """Routes jobs between frontends and workers. Single-threaded."""

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
        self.counters: collections.Counter[str] = collections.Counter()
        self.stats = PoolStats()
        # Deaths per host not yet followed by a new registration from that
        # host: the next READY from it counts as a restart.
        self._deaths_by_host = HostDeaths(settings.max_workers)
        # Peer-driven log lines (registrations, losses) at a bounded rate.
        self._log = LogThrottle(log)
        # Frontends whose send pipe was full; dropped after the current
        # message (never in the middle of handling one).
        self._stuck_frontends: set[bytes] = set()
        #: SUBMITs waiting for running ``--threads auto`` workers to step down.
        self._held = HeldSubmits()
        for name in ("worker_refused_full", "worker_unresponsive",
                     "frontend_send_full", "malformed_dropped",
                     "submits_held_for_step_down", "step_down_waits_expired"):
            self.counters[name] = 0  # exported from the start, as zeros
        self._frontend_sock: zmq.Socket | None = None
        self._worker_sock: zmq.Socket | None = None
        self._sd = notifier or SilentNotifier()
        self.security = BrokerSecurity(
            settings.curve_secret_key, settings.curve_authorized_workers,
            settings.curve_authorized_frontends, settings.insecure_plaintext,
            on_refused=self._count_refusal,
        )
        #: Each role's authorized keys, re-read once per heartbeat; None in
        #: plaintext. Every message's CURVE key is checked against it.
        self._allowed_keys: dict[str, frozenset[bytes]] | None = None
        if self.security.enabled:
            # Created here so the ZAP thread only ever increments them.
            for name in ("curve_refused", *(f"curve_refused_{role}" for role in
                                            (curve.WORKERS, curve.FRONTENDS))):
                self.counters[name] = 0

    def _count_refusal(self, role: str) -> None:
        """Called from the ZAP thread for each refused handshake."""
        self.counters["curve_refused"] += 1
        self.counters[f"curve_refused_{role}"] += 1

    # --- sockets ---------------------------------------------------------------

    def _router(self, endpoint: str, role: str, max_frame_bytes: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # libzmq drops the connection of a peer that sends a larger frame,
        # before buffering it (the body frame is the large one).
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        self.security.configure(sock, role)
        sock.bind(endpoint)
        return sock

    def bind(self) -> None:
        self.security.check_endpoints(
            (self.settings.frontends_endpoint, self.settings.workers_endpoint)
        )
        self.security.start(self.ctx)
        self._allowed_keys = self.security.current_keys()
        self._frontend_sock = self._router(self.settings.frontends_endpoint,
                                           curve.FRONTENDS,
                                           limits.MAX_FRAME_FROM_FRONTEND)
        self._worker_sock = self._router(self.settings.workers_endpoint,
                                         curve.WORKERS, limits.MAX_FRAME_FROM_WORKER)
        log.info(
            "broker listening: frontends=%s workers=%s",
            self.settings.frontends_endpoint,
            self.settings.workers_endpoint,
        )

    def close(self) -> None:
        for sock in (self._frontend_sock, self._worker_sock):
            if sock is not None:
                sock.close(linger=0)
        self.security.stop()

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[bytes]) -> bool:
        """Send to one peer; False if the peer is gone or its pipe is full
        (never raises, never blocks)."""
        try:
            # Never blocking: with ROUTER_MANDATORY a full pipe would otherwise
            # block the whole loop until the peer reads.
            send_frames(sock, [identity, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self.counters["send_unroutable"] += 1
                if exc.errno == zmq.EAGAIN and sock is self._frontend_sock:
                    self._stuck_frontends.add(identity)
                return False
            raise

    def _to_frontend(self, identity: bytes, msg_or_frames) -> bool:
        frames = (
            msg_or_frames
            if isinstance(msg_or_frames, list)
            else msg_or_frames.to_wire()
        )
        return self._send(self._frontend_sock, identity, frames)

    def _to_worker(self, identity: bytes, msg_or_frames) -> bool:
        frames = (
            msg_or_frames
            if isinstance(msg_or_frames, list)
            else msg_or_frames.to_wire()
        )
        return self._send(self._worker_sock, identity, frames)

    # --- main loop ---------------------------------------------------------------

    def run(self, stop: StopSignal) -> None:
        """Serve until ``stop`` is set."""
        if self._frontend_sock is None:
            self.bind()
        self._sd.ready("broker listening")
        poller = zmq.Poller()
        poller.register(self._frontend_sock, zmq.POLLIN)
        poller.register(self._worker_sock, zmq.POLLIN)
        interval_s = self.settings.heartbeat_interval_s
        next_beat = time.monotonic()
        try:
            while not stop.is_set():
                wake_at = min(next_beat, self._held.next_deadline() or next_beat)
                timeout_ms = max(0.0, wake_at - time.monotonic()) * 1000
                ready = dict(poller.poll(min(timeout_ms, interval_s * 1000)))
                if self._worker_sock in ready:
                    self._read_workers()
                if self._frontend_sock in ready:
                    self._drain(self._frontend_sock, curve.FRONTENDS,
                                self._on_frontend_frames, self._malformed)
                self._drop_stuck_frontends()
                now = time.monotonic()
                if self._held:
                    held = self._held.due(now)
                    self.counters["step_down_waits_expired"] += len(held)
                    self._send_held(held)
                if now >= next_beat:
                    self._heartbeat_and_expire(now)
                    self._sd.watchdog(now)
                    next_beat = now + interval_s
        finally:
            self._sd.stopping()
            self.close()
            log.info("broker stopped")

    def _read_workers(self) -> None:
        self._drain(self._worker_sock, curve.WORKERS, self._on_worker_frames,
                    self._on_malformed_from_worker)

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
                self.counters["drain_budget_spent"] += 1
                return
            try:
                if self._allowed_keys is None:
                    frames = recv_frames(sock)
                else:
                    frames = self._recv_authorized(sock, role)
            except zmq.Again:
                return
            if frames is None:
                continue
            if len(frames) < 2:
                self._malformed(b"?", "no routing identity")
                continue
            identity, body = frames[0], frames[1:]
            if sock is self._worker_sock and self._relay_token(identity, body):
                continue
            try:
                msg = messages.decode(body)
            except messages.MalformedMessage as exc:
                malformed(identity, str(exc), body)
                continue
            handle(identity, msg, body)

    def _relay_token(self, identity: bytes, body: list[bytes]) -> bool:
        """Relay a TOKEN of the job its worker holds without decoding it;
        False (nothing done) for any other frame, which is decoded as usual.

        TOKEN is nearly every frame the broker sees, and decoding one cost
        about a sixth of the broker's CPU per frame (BENCHMARKS.md section
        13). ``messages.is_token_of`` checks what routing needs: the command,
        and that the body names the job this worker holds, so a frame never
        reaches another job's client. The frontend decodes every frame anyway
        and checks the rest; a broken TOKEN comes back as a CANCEL that says
        so (``_on_broken_job``), and is then handled as a broken frame here is.
        """
        now = time.monotonic()
        slot = self.ledger.touch_worker(identity, now)
        if slot is None or slot.job_id is None:
            return False
        job = self.ledger.jobs[slot.job_id]
        if not messages.is_token_of(body, job.tag):
            return False
        self.counters["tokens_relayed"] += 1
        self._relay(job, body, now)
        return True

    def _relay(self, job: ledger_mod.Job, frames: list[bytes], now: float) -> None:
        """Pass one of the job's TOKEN frames to its frontend, decoded or not."""
        job.heard = True
        if not self._to_frontend(job.frontend, frames):
            # Its frontend is gone: stop the work instead of computing
            # tokens nobody will read.
            self._on_cancel(job.frontend, job.job_id, now)

    def _recv_authorized(self, sock: zmq.Socket, role: str) -> list[bytes] | None:
        """One message, or None if its sender's key is no longer authorized.

        ZAP checked the key once, at the handshake; the key may have been
        removed or overwritten since. libzmq stamps every message with the
        key ZAP accepted (its ``User-Id`` property), so the check is a set
        lookup. Raises ``zmq.Again`` when nothing is waiting.
        """
        first = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        if first.more:
            frames += sock.recv_multipart()
        try:
            key = first.get("User-Id").encode()
        except zmq.ZMQError:
            key = b""  # no key on record: not one we authorized
        if key in self._allowed_keys[role]:
            return frames
        self._revoked(role, frames[0], key)
        return None

    def _revoked(self, role: str, ident: bytes, key: bytes) -> None:
        """Drop a peer whose key was revoked after its handshake.

        It leaves the ledger (a worker's job fails, a frontend's jobs are
        cancelled) and hears nothing more from us: its link redials after
        its silence window, and ZAP refuses the new handshake.
        """
        self.counters["curve_revoked_dropped"] += 1
        now = time.monotonic()
        if role == curve.WORKERS and ident in self.ledger.workers:
            self.counters["curve_revoked_peers"] += 1
            log.warning("CURVE key %s revoked: dropping its worker",
                        key.decode(errors="replace"))
            self._worker_died(ident, "CURVE key revoked")
        elif role == curve.FRONTENDS and ident in self.ledger.frontends:
            self.counters["curve_revoked_peers"] += 1
            log.warning("CURVE key %s revoked: dropping its frontend",
                        key.decode(errors="replace"))
            self._frontend_gone(ident, now)

    def _malformed(self, identity: bytes, why: str, frames=None) -> None:
        self.counters["malformed_dropped"] += 1
        # Rate-limited: a garbage flood must not become a log flood.
        self._log.warning(
            "malformed", "dropped malformed message #%d from %s: %s",
            self.counters["malformed_dropped"], identity[:16].hex(), why[:200],
        )

    def _on_malformed_from_worker(self, identity: bytes, why: str,
                                  frames: list[bytes]) -> None:
        """Drop and count, as from any peer; and if a registered worker's
        broken frame was a job frame while it holds a job, that job can no
        longer end well: its output or its terminal frame is lost.

        The job fails at once with ``worker_protocol_error`` (the client gets
        a clean 502 or error event, and the lease its terminal frame), and
        the worker is forgotten and told DISCONNECT: a worker that breaks the
        protocol mid-job is not trusted with the next one until it registers
        again (a sound worker does, with READY, once its job is over).
        A broken heartbeat is only dropped: it loses nothing.
        """
        self._malformed(identity, why)
        slot = self.ledger.workers.get(identity)
        if (slot is None or slot.job_id is None
                or messages.command_class(frames) not in messages.JOB_FRAMES):
            return
        self._worker_broke_job(slot, why)

    def _on_broken_job(self, frontend: bytes, job_id: str, why: str) -> None:
        """The frontend found a TOKEN of this job broken (a CANCEL that says
        so): the broker relayed it undecoded (``_relay_token``). Counted and
        handled as if the broker had found it."""
        job = self.ledger.jobs.get(job_id)
        if job is None or job.frontend != frontend:
            return  # already over, or not this frontend's to judge
        slot = self.ledger.workers.get(job.worker)
        if slot is None or slot.job_id != job_id:
            return
        self._malformed(job.worker, f"(found by the frontend) {why}")
        self._worker_broke_job(slot, why)

    def _worker_broke_job(self, slot: ledger_mod.WorkerSlot, why: str) -> None:
        self.counters["worker_protocol_errors"] += 1
        log.warning("worker sent a malformed job frame mid-job: slot=%d pid=%d: "
                    "%s; failing its job and disconnecting it",
                    slot.slot_id, slot.info.pid, why[:200])
        job = self.ledger.remove_worker(slot.identity)
        if job is not None:
            self.stats.job_lost()
            self._fail_job(job, ErrorCode.WORKER_PROTOCOL_ERROR,
                           "the model worker sent a malformed frame")
        self._to_worker(slot.identity, messages.Disconnect("malformed job frame"))

    # --- frontend side -----------------------------------------------------------

    def _on_frontend_frames(self, ident: bytes, msg: messages.Message, raw) -> None:
        now = time.monotonic()
        known = self.ledger.touch_frontend(ident, now)
        if isinstance(msg, messages.Hello):
            self.ledger.register_frontend(ident, now, msg.pid, msg.host)
            self._log.info("frontend registered",
                           "frontend registered: pid=%d host=%s", msg.pid, msg.host)
        elif isinstance(msg, messages.Submit):
            if not known:
                # Serve it (refusing the first request after a broker restart
                # helps nobody), but first say DISCONNECT: this frontend may
                # still wait on jobs a previous broker accepted, and must fail
                # them. Frames are ordered, so the DISCONNECT arrives before
                # this job's ACCEPTED, and the frontend fails only jobs
                # accepted before it.
                self.counters["unknown_peer"] += 1
                self._to_frontend(ident, messages.Disconnect("unknown frontend"))
                self.ledger.register_frontend(ident, now)
            self._on_submit(ident, msg, raw, now)
        elif not known:
            # STATUS too: a reply is the one large thing the broker sends, so
            # only a registered frontend (whose pipe we watch, see
            # ``_drop_stuck_frontends``) gets one. A frontend re-sends its
            # pending STATUS after it registers again.
            self.counters["unknown_peer"] += 1
            self._to_frontend(ident, messages.Disconnect("unknown frontend"))
        elif isinstance(msg, messages.Status):
            self.counters["status_requests"] += 1
            snapshot = self.snapshot(now)
            self._to_frontend(ident, messages.StatusReply(msg.request_id, snapshot))
        elif isinstance(msg, messages.Cancel):
            if msg.broken:
                self._on_broken_job(ident, msg.job_id, msg.broken)
            else:
                self._on_cancel(ident, msg.job_id, now)
        elif isinstance(msg, messages.Credit):
            job = self.ledger.jobs.get(msg.job_id)
            if job is not None and job.frontend == ident:
                self._to_worker(job.worker, raw)
        elif isinstance(msg, messages.Heartbeat):
            pass
        else:
            self.counters["protocol_violation"] += 1
            self._log.warning("frontend violation",
                              "frontend sent %s; disconnecting it",
                              type(msg).__name__)
            self._to_frontend(ident, messages.Disconnect("unexpected command"))

    def _on_submit(
        self, ident: bytes, msg: messages.Submit, raw: list[bytes], now: float
    ) -> None:
        self.counters["submitted"] += 1
        if msg.job_id in self.ledger.jobs:
            self._to_frontend(
                ident,
                messages.Error(msg.job_id, ErrorCode.DUPLICATE_JOB, "duplicate job id"),
            )
            return
        if msg.id_slot == -1:
            slot = self.ledger.assign(msg.job_id, ident, now,
                                      msg.prefix_blocks[:MAX_BLOCKS])
        else:
            try:
                slot = self.ledger.assign_slot(msg.id_slot, msg.job_id, ident, now,
                                               msg.prefix_blocks[:MAX_BLOCKS])
            except KeyError:
                # llama.cpp's words for a slot it does not have.
                self._to_frontend(ident, messages.Error(
                    msg.job_id, ErrorCode.INVALID_SLOT, "Invalid slot ID"))
                return
        if slot is not None and slot.shared_blocks_at_assign:
            self.counters["routed_by_prefix"] += 1
        if slot is None:
            self.counters["no_slot"] += 1
            self._to_frontend(
                ident, messages.NoSlot(msg.job_id, self.ledger.retry_after_s(now))
            )
            return
        # Before the SUBMIT: the new worker learns its own share first, and
        # the host's running workers step down before the new job starts
        # (its SUBMIT waits for them: workers.broker.step_down).
        stepping_down = self._retune_threads()
        stepping_down.pop(slot.identity, None)
        if stepping_down and self.settings.step_down_wait_s > 0:
            self.counters["submits_held_for_step_down"] += 1
            self._held.hold(msg.job_id, slot.identity, raw, stepping_down,
                            now + self.settings.step_down_wait_s)
        elif not self._to_worker(slot.identity, raw):
            # The worker vanished between its last beat and now.
            self._worker_died(slot.identity, "unreachable")
            self._to_frontend(
                ident, messages.NoSlot(msg.job_id, timing.RETRY_AFTER_MIN_S)
            )
            return
        self._to_frontend(
            ident, messages.Accepted(msg.job_id, slot.slot_id, slot.info.model)
        )

    def _on_cancel(self, ident: bytes, job_id: str, now: float) -> None:
        job = self.ledger.jobs.get(job_id)
        if job is None or job.frontend != ident:
            return  # already finished: the terminal frame crossed the cancel
        self._cancel_job(job, now)

    def _cancel_job(self, job: ledger_mod.Job, now: float) -> None:
        if self.ledger.request_cancel(job.job_id, now) is not None:
            # A held SUBMIT goes first: the worker then ends the job itself,
            # with the terminal frame that frees the slot.
            self._send_held([self._held.release(job.job_id)])
            self._to_worker(job.worker, messages.Cancel(job.job_id))

    def _send_held(self, held: list[HeldSubmit | None]) -> None:
        """Send the SUBMITs whose wait for a step-down is over, if their job
        is still the one assigned to that worker."""
        for h in held:
            if h is None:
                continue
            job = self.ledger.jobs.get(h.job_id)
            if job is None or job.worker != h.worker:
                continue  # failed or ended meanwhile (its worker died)
            if not self._to_worker(h.worker, h.frames):
                self._worker_died(h.worker, "unreachable")

    # --- worker side -------------------------------------------------------------

    def _pool_full(self, ident: bytes, msg: messages.Loading | messages.Ready
                   ) -> bool:
        """Refuse a new worker beyond ``max_workers`` (True if refused)."""
        if (ident in self.ledger.workers
                or len(self.ledger.workers) < self.settings.max_workers):
            return False
        self.counters["worker_refused_full"] += 1
        self._log.warning(
            "worker refused", "worker refused: the pool is full (%d workers, "
            "--max-workers): name=%s pid=%d host=%s",
            len(self.ledger.workers), msg.worker_name, msg.pid, msg.host)
        self._to_worker(ident, messages.Disconnect("the pool is full"))
        return True

    def _on_worker_frames(self, ident: bytes, msg: messages.Message, raw) -> None:
        now = time.monotonic()
        if isinstance(msg, messages.Loading):
            if self._pool_full(ident, msg):
                return
            if ident not in self.ledger.workers:
                self._log.info("worker loading",
                               "worker loading: name=%s pid=%d host=%s model=%s",
                               msg.worker_name, msg.pid, msg.host, msg.model)
            self.ledger.register_loading(ident, msg, now)
            return
        if isinstance(msg, messages.Ready):
            if self._pool_full(ident, msg):
                return
            self.counters["worker_registrations"] += 1
            if self._deaths_by_host.registered(msg.host):
                self.counters["worker_restarts"] += 1
                self._log.info("worker restarted",
                               "worker restarted on host %s (pid %d)",
                               msg.host, msg.pid)
            slot, orphan = self.ledger.register_worker(ident, msg, now)
            # Acknowledge at once: the worker ignores DISCONNECTs until it
            # hears from us after READY (they answer older messages).
            self._to_worker(ident, messages.Heartbeat())
            if orphan is not None:
                self.stats.job_lost()
                self._fail_job(orphan, ErrorCode.WORKER_RESTARTED,
                               "worker re-registered")
            self._log.info(
                "worker registered",
                "worker registered: slot=%d name=%s pid=%d host=%s model=%s",
                slot.slot_id, msg.worker_name, msg.pid, msg.host, msg.model,
            )
            return
        slot = self.ledger.touch_worker(ident, now)
        if slot is None:
            self.counters["unknown_peer"] += 1
            self._to_worker(ident, messages.Disconnect("unknown worker"))
            return
        if isinstance(msg, messages.CacheReport):
            self.ledger.record_cache_report(slot, msg)
        elif isinstance(msg, messages.Heartbeat):
            progress = msg.progress
            if progress is not None and slot.job_id and (
                    progress.job_id == slot.job_id):
                self.ledger.record_progress(slot, progress, now)
                self.ledger.job_heard(slot.job_id)
        elif isinstance(msg, messages.ThreadsSet):
            self._send_held(self._held.stepped_down(ident, msg.n_threads))
        elif isinstance(msg, messages.Disconnect):
            # The worker is shutting down: no new jobs. Its current job (if
            # any) still ends with a terminal frame, which frees the slot.
            self._log.info("worker leaving",
                           "worker leaving (%s): slot=%d pid=%d",
                           msg.reason[:200], slot.slot_id, slot.info.pid)
            slot.draining = True
            if slot.job_id is None:
                self.ledger.remove_worker(ident)
        elif isinstance(msg, messages.JOB_FRAMES):
            if msg.job_id != slot.job_id:
                self.counters["stale_frames"] += 1
                return
            job = self.ledger.jobs[msg.job_id]
            if isinstance(msg, messages.TERMINAL):
                job.heard = True
                self._to_frontend(job.frontend, raw)
                self._finish(job, msg, now)
            else:
                self._relay(job, raw, now)
        else:
            self.counters["protocol_violation"] += 1
            self._log.warning("worker violation", "worker sent %s; disconnecting it",
                              type(msg).__name__)
            self._to_worker(ident, messages.Disconnect("unexpected command"))

    def _finish(self, job: ledger_mod.Job, msg: messages.Message, now: float) -> None:
        self.ledger.finish(job.job_id, now)
        self.stats.job_ended(msg, job.cancel_requested_at, now)
        slot = self.ledger.workers.get(job.worker)
        if slot is not None and slot.draining:
            self.ledger.remove_worker(job.worker)
        self.counters["finished"] += 1
        self._send_held(self._held.worker_idle(job.worker))
        self._retune_threads()  # the host's other busy workers step up

    def _retune_threads(self) -> dict[bytes, int]:
        """Send THREADS to each busy ``--threads auto`` worker whose share of
        its host's cores changed (``workers.broker.thread_budget``).

        Returns the workers told to use fewer threads than before, with the
        count each was told.
        """
        stepping_down: dict[bytes, int] = {}
        for ident, n_threads in budgets(self.ledger.workers.values()).items():
            slot = self.ledger.workers[ident]
            # Never told: the worker loaded with all its host's pool cores.
            current = slot.threads_told or slot.info.pool_cores
            if current != n_threads:
                slot.threads_told = n_threads
                self._to_worker(ident, messages.Threads(n_threads))
                if n_threads < current:
                    stepping_down[ident] = n_threads
        return stepping_down

    def _fail_job(self, job: ledger_mod.Job, code: ErrorCode, message: str) -> None:
        self.counters["failed_" + code] += 1
        self._to_frontend(job.frontend, messages.Error(job.job_id, code, message))

    def _worker_died(self, ident: bytes, why: str) -> None:
        slot = self.ledger.workers.get(ident)
        orphan = self.ledger.remove_worker(ident)
        self.counters["worker_deaths"] += 1
        self._send_held(self._held.worker_idle(ident))
        if slot is not None:
            self._deaths_by_host.died(slot.info.host)
            self._log.warning(
                "worker lost", "worker lost (%s): slot=%d pid=%d host=%s",
                why, slot.slot_id, slot.info.pid, slot.info.host,
            )
        if orphan is not None:
            self.stats.job_lost()
            self._fail_job(orphan, ErrorCode.WORKER_DIED,
                           "the model worker died mid-job")

    # --- liveness ----------------------------------------------------------------

    def _frontend_gone(self, ident: bytes, now: float) -> None:
        """Forget a frontend and cancel the jobs it held."""
        for job in self.ledger.remove_frontend(ident):
            self._cancel_job(job, now)

    def _drop_stuck_frontends(self) -> None:
        """A frontend whose pipe is full does not read: frozen or hostile. A
        real one reads everything at once (see the module docstring), so it
        is treated as gone; if it was only frozen it hears DISCONNECT on its
        next message and registers again, failing the jobs it held."""
        if not self._stuck_frontends:
            return
        now = time.monotonic()
        for ident in self._stuck_frontends:
            if ident in self.ledger.frontends:
                self.counters["frontend_send_full"] += 1
                self._log.warning("frontend lost",
                                  "frontend lost (send queue full): %s",
                                  ident[:16].hex())
                self._frontend_gone(ident, now)
        self._stuck_frontends.clear()

    def _expire_mute_jobs(self, now: float) -> None:
        """Fail jobs whose worker showed no sign of them in time, and drop
        that worker (settings: ``first_frame_timeout_s``)."""
        deadline = now - self.settings.first_frame_timeout_s
        mute = [job for job in self.ledger.jobs.values()
                if not job.heard and job.submitted_at < deadline]
        for job in mute:
            slot = self.ledger.workers.get(job.worker)
            self.counters["worker_unresponsive"] += 1
            self._log.warning(
                "worker unresponsive",
                "worker unresponsive: no sign of job %s for %.0fs; dropped "
                "(slot=%s pid=%s host=%s)", job.job_id,
                self.settings.first_frame_timeout_s,
                getattr(slot, "slot_id", "?"),
                slot.info.pid if slot else "?", slot.info.host if slot else "?")
            orphan = self.ledger.remove_worker(job.worker)
            self._to_worker(job.worker, messages.Disconnect("no sign of the job"))
            if orphan is not None:
                self.stats.job_lost()
                self._fail_job(orphan, ErrorCode.WORKER_UNRESPONSIVE,
                               "the model worker did not start the job in time")


    def _heartbeat_and_expire(self, now: float) -> None:
        if self._allowed_keys is not None:
            self._allowed_keys = self.security.current_keys()
        dead_workers, dead_frontends = self.ledger.expired(now)
        for ident in dead_workers:
            self._worker_died(ident, "heartbeat timeout")
        for ident in dead_frontends:
            self.counters["frontend_deaths"] += 1
            self._log.warning("frontend lost",
                              "frontend lost (heartbeat timeout): %s",
                              ident[:16].hex())
            self._frontend_gone(ident, now)
        self._expire_mute_jobs(now)
        # Also catches busy workers that died or left since the last change.
        self._retune_threads()
        if self.metrics is not None:
            self.metrics.publish(self.snapshot(now))
        beat = messages.Heartbeat().to_wire()
        unreachable = [ident for ident in list(self.ledger.workers)
                       if not self._to_worker(ident, beat)]
        if unreachable:
            # A worker that said goodbye and closed its socket is unreachable
            # before this loop has read the DISCONNECT queued behind the
            # closed pipe: read it first, so a goodbye is not a death.
            self._read_workers()
            for ident in unreachable:
                if ident in self.ledger.workers:
                    self._worker_died(ident, "unreachable")
        for ident in list(self.ledger.frontends):
            self._to_frontend(ident, beat)
        self._drop_stuck_frontends()

    def snapshot(self, now: float) -> PoolStatus:
        return self.ledger.snapshot(now, dict(self.counters), self.stats.totals())
