"""The slot ledger: which worker is free, which job holds which slot.

Pure bookkeeping with no sockets and no clock of its own (every call takes
``now``), so property tests can drive it through any order of events. The
broker is its only owner.

A worker is one slot. Its states:

* ``loading``: announced itself, still loading its model; gets no job;
* ``failed``: its supervisor holds it after a crash loop; the process only
  says why (``failure``), and never gets a job;
* ``idle``: registered, free for a job;
* ``busy``: running a job;
* ``cancelling``: its frontend asked to cancel; still busy until the worker's
  terminal frame arrives. The slot is free only after that frame, never
  before (DESIGN.md, "acknowledged cancel").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from protocol import limits, messages, timing
from protocol.payloads import JobProgress, PoolStatus, PoolTotals, SlotStatus
from protocol.prefix import MAX_BLOCKS
from protocol.prompt_cache import PromptCacheStatus
from workers.broker.cache_claims import ClaimTrust
from workers.broker.model_index import ModelIndex

LOADING = "loading"
FAILED = "failed"
IDLE = "idle"
BUSY = "busy"
CANCELLING = "cancelling"


@dataclasses.dataclass
class WorkerSlot:
    """One registered worker process = one slot."""

    identity: bytes
    slot_id: int
    info: messages.Ready
    last_seen: float
    registered_at: float
    state: str = IDLE
    job_id: str | None = None
    lease_taken_at: float | None = None
    #: The current job's last heartbeat (None while idle or before it).
    progress: JobProgress | None = None
    #: When that heartbeat arrived (monotonic): its estimates age from there.
    progress_at: float | None = None
    jobs_served: int = 0
    # When the worker last became idle; the least recently used idle worker
    # gets the next job, which spreads load evenly.
    idle_since: float = 0.0
    #: Said goodbye (SIGTERM): gets no new job, leaves when its job ends.
    draining: bool = False
    #: How the worker's last run died, while it loads again or is held
    #: (``messages.Loading.failure``); "" once it is ready.
    failure: str = ""
    #: Prefix fingerprints of every state the worker can start a prompt
    #: from (its live KV sequence and its prompt-state cache), from its last
    #: CACHE_REPORT plus the prompt of any job given to it since. Fingerprint
    #: ``i`` covers blocks ``0..i``, so the worker holds a prompt's first
    #: ``k`` blocks exactly when the prompt's ``k``-th is in here.
    cached_blocks: frozenset = frozenset()
    #: The part of ``cached_blocks`` its live KV sequence holds (the
    #: report's first state, or the last job's prompt): a prompt it serves
    #: needs no state restored.
    live_blocks: frozenset = frozenset()
    #: The figures of its last CACHE_REPORT (for /slots and /metrics).
    prompt_cache: PromptCacheStatus | None = None
    #: Blocks the current job's prompt shared with that cache when assigned.
    shared_blocks_at_assign: int = 0
    #: The thread count last sent in THREADS (``--threads auto`` workers);
    #: None: nothing sent yet.
    threads_told: int | None = None
    #: How many THREADS it was sent: each one's ``seq``, which its
    #: THREADS_SET echoes.
    threads_seq: int = 0
    #: Whether its cache claims steer routing, from how its past claims
    #: fared (``workers.broker.cache_claims``).
    claims: ClaimTrust = dataclasses.field(default_factory=ClaimTrust)

    def routing_blocks(self, blocks: list) -> int:
        """Leading blocks of a prompt this worker holds, as routing counts
        them: 0 while its claims are not believed."""
        return held_blocks(self.cached_blocks, blocks) if self.claims.trusted else 0

    def live_routing_blocks(self, blocks: list) -> int:
        """Of those, the blocks its live sequence holds."""
        return held_blocks(self.live_blocks, blocks) if self.claims.trusted else 0


@dataclasses.dataclass
class Job:
    """A job that holds a slot."""

    job_id: str
    frontend: bytes
    worker: bytes
    submitted_at: float
    cancel_requested_at: float | None = None
    #: The worker showed it has the job: a job frame, or a heartbeat whose
    #: progress names it. Until then the first-frame deadline runs.
    heard: bool = False
    #: ``job_id`` as it opens the job's frames on the wire
    #: (``messages.job_id_tag``): the relay's check of a TOKEN.
    tag: bytes = b""
    #: For the broker's log lines: the HTTP request, and what may be shown
    #: of its API key (``messages.Submit``).
    request_id: str = ""
    key: str = ""
    #: Leading blocks of its prompt the worker claimed to hold when the job
    #: was assigned (believed or not), and whether its FINAL can check that
    #: claim (``workers.broker.cache_claims``).
    claimed_blocks: int = 0
    check_claim: bool = False
    #: Its worker's model (the name, never an alias): whose totals it
    #: counts in (``workers.broker.pool_stats``).
    model: str = ""

    def named(self) -> str:
        """``job 3f2a.. (request 9c1.., key abcd)``, for log lines."""
        return (f"job {self.job_id} (request {self.request_id or '-'}, "
                f"key {self.key or '-'})")


@dataclasses.dataclass
class FrontendPeer:
    """A registered frontend process."""

    identity: bytes
    last_seen: float
    pid: int = 0
    host: str = ""


#: Most fingerprints the ledger keeps per worker: a full CACHE_REPORT.
MAX_HELD_FINGERPRINTS = limits.MAX_REPORTED_STATES * MAX_BLOCKS


def held_blocks(held: frozenset, blocks: list) -> int:
    """How many leading blocks of a prompt (its running fingerprints) a
    worker holds: fingerprint ``k - 1`` covers all of the first ``k``."""
    n = 0
    for fp in blocks:
        if fp not in held:
            break
        n += 1
    return n


class Ledger:
    """Slot bookkeeping for one broker.

    Args:
        peer_timeout_s: a peer not heard from for this long is dead.
    """

    def __init__(self, peer_timeout_s: float, prefer_prefix: bool = True) -> None:
        self.peer_timeout_s = peer_timeout_s
        #: False (``--routing lru``): ignore what workers hold.
        self.prefer_prefix = prefer_prefix
        self.workers: dict[bytes, WorkerSlot] = {}
        self.jobs: dict[str, Job] = {}
        self.frontends: dict[bytes, FrontendPeer] = {}
        #: The workers by model: a job gets a slot of its own model only.
        self.models = ModelIndex()
        self._slot_ids = itertools.count()

    # --- peers -----------------------------------------------------------------

    def register_worker(
        self, identity: bytes, ready: messages.Ready, now: float
    ) -> tuple[WorkerSlot, Job | None]:
        """Add (or re-add) a worker as idle.

        Returns the slot and, if the same identity was holding a job, that job:
        a worker only sends READY when it is idle, so the job is over and its
        frontend must be told.
        """
        previous = self.workers.get(identity)
        orphan = self.remove_worker(identity)
        # A loading worker keeps its slot id when it becomes ready.
        slot_id = previous.slot_id if previous is not None else next(self._slot_ids)
        slot = WorkerSlot(
            identity=identity,
            slot_id=slot_id,
            info=ready,
            last_seen=now,
            registered_at=now,
            idle_since=now,
        )
        self.workers[identity] = slot
        self.models.add(slot)
        return slot, orphan

    def register_loading(
        self, identity: bytes, info: messages.Loading, now: float
    ) -> WorkerSlot:
        """A worker that is still loading: visible, never assigned."""
        slot = self.workers.get(identity)
        if slot is None:
            ready = messages.Ready(info.worker_name, info.model, 0, info.pid,
                                   info.host, aliases=info.aliases)
            slot = WorkerSlot(identity, next(self._slot_ids), ready, now, now,
                              state=LOADING)
            self.workers[identity] = slot
            self.models.add(slot)
        slot.last_seen = now
        slot.failure = info.failure
        slot.state = FAILED if info.held else LOADING
        return slot

    def remove_worker(self, identity: bytes) -> Job | None:
        """Forget a worker; return the job it held, if any (now orphaned)."""
        slot = self.workers.pop(identity, None)
        if slot is not None:
            self.models.discard(slot)
        if slot is None or slot.job_id is None:
            return None
        return self.jobs.pop(slot.job_id, None)

    def register_frontend(
        self, identity: bytes, now: float, pid: int = 0, host: str = ""
    ) -> None:
        self.frontends[identity] = FrontendPeer(identity, now, pid, host)

    def remove_frontend(self, identity: bytes) -> list[Job]:
        """Forget a frontend; return the jobs it held (to be cancelled)."""
        self.frontends.pop(identity, None)
        return [job for job in self.jobs.values() if job.frontend == identity]

    def touch_worker(self, identity: bytes, now: float) -> WorkerSlot | None:
        slot = self.workers.get(identity)
        if slot is not None:
            slot.last_seen = now
        return slot

    def touch_frontend(self, identity: bytes, now: float) -> bool:
        peer = self.frontends.get(identity)
        if peer is None:
            return False
        peer.last_seen = now
        return True

    def expired(self, now: float) -> tuple[list[bytes], list[bytes]]:
        """Identities of workers and frontends that missed their liveness."""
        deadline = now - self.peer_timeout_s
        dead_workers = [i for i, w in self.workers.items() if w.last_seen < deadline]
        dead_frontends = [
            i for i, f in self.frontends.items() if f.last_seen < deadline
        ]
        return dead_workers, dead_frontends

    # --- jobs --------------------------------------------------------------------

    def assign(self, job_id: str, frontend: bytes, now: float,
               prefix_blocks: list | None = None,
               model: str = "") -> WorkerSlot | None:
        """Give the job an idle slot of ``model`` ("": of any model), or None
        if all of them are busy.

        The idle worker that holds the longest run of the prompt's prefix
        blocks (live or cached) wins; among equals, the one whose live
        sequence holds them (no state to restore: the slots of a batched
        worker all report the worker's one cache, and only one holds the
        prompt live), then the least recently used one. A busy holder is
        never waited for, and a worker whose claims failed counts as
        holding nothing (``cache_claims``).
        """
        if job_id in self.jobs:
            raise ValueError(f"duplicate job id {job_id!r}")
        idle = self.idle_slots(model)
        if not idle:
            return None
        blocks = prefix_blocks or []
        if self.prefer_prefix:
            slot = min(idle, key=lambda w: (-w.routing_blocks(blocks),
                                            -w.live_routing_blocks(blocks),
                                            w.idle_since))
        else:
            slot = min(idle, key=lambda w: w.idle_since)
        return self._lease(slot, job_id, frontend, now, blocks)

    def assign_slot(self, slot_id: int, job_id: str, frontend: bytes, now: float,
                    prefix_blocks: list | None = None,
                    model: str = "") -> WorkerSlot | None:
        """Give the job exactly slot ``slot_id`` (llama.cpp's ``id_slot``), or
        None if that slot is busy, draining or loading.

        Raises:
            KeyError: no slot has that id, or it serves another ``model``.
        """
        if job_id in self.jobs:
            raise ValueError(f"duplicate job id {job_id!r}")
        slot = next((w for w in self.workers.values() if w.slot_id == slot_id), None)
        if slot is None or (model and slot.info.model != model):
            raise KeyError(slot_id)
        if slot.state != IDLE or slot.draining:
            return None
        return self._lease(slot, job_id, frontend, now, prefix_blocks or [])

    def _lease(self, slot: WorkerSlot, job_id: str, frontend: bytes, now: float,
               blocks: list) -> WorkerSlot:
        claimed = held_blocks(slot.cached_blocks, blocks)
        slot.shared_blocks_at_assign = slot.routing_blocks(blocks)
        # The prompt is about to be the worker's live sequence; its next
        # CACHE_REPORT (sent before the job's terminal frame) says exactly.
        # A worker that never reports (the synthetic engine) holds just the
        # last prompt; the cap bounds the set if reports stop arriving.
        grown = slot.cached_blocks | frozenset(blocks)
        slot.cached_blocks = (grown if slot.prompt_cache is not None
                              and len(grown) <= MAX_HELD_FINGERPRINTS
                              else frozenset(blocks))
        slot.live_blocks = frozenset(blocks)
        slot.state = BUSY
        slot.job_id = job_id
        slot.lease_taken_at = now
        slot.progress = None
        slot.progress_at = None
        self.jobs[job_id] = Job(job_id, frontend, slot.identity, now,
                                tag=messages.job_id_tag(job_id),
                                claimed_blocks=claimed, model=slot.info.model)
        return slot

    def record_cache_report(self, slot: WorkerSlot,
                            report: messages.CacheReport) -> None:
        """What the worker holds now (replaces what it said before)."""
        slot.cached_blocks = frozenset(
            fp for state in report.states for fp in state[:MAX_BLOCKS])
        slot.live_blocks = frozenset(report.states[0][:MAX_BLOCKS]
                                     if report.states else ())
        slot.prompt_cache = report.status

    def job_heard(self, job_id: str) -> None:
        """The job's worker showed it has the job (stops its deadline)."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.heard = True

    def request_cancel(self, job_id: str, now: float) -> Job | None:
        """Mark a job as cancelling; return it if this is the first request."""
        job = self.jobs.get(job_id)
        if job is None or job.cancel_requested_at is not None:
            return None
        job.cancel_requested_at = now
        slot = self.workers.get(job.worker)
        if slot is not None:
            slot.state = CANCELLING
        return job

    def finish(self, job_id: str, now: float) -> Job | None:
        """The job's terminal frame passed: free its slot. Idempotent."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return None
        slot = self.workers.get(job.worker)
        if slot is not None and slot.job_id == job_id:
            slot.state = IDLE
            slot.job_id = None
            slot.lease_taken_at = None
            slot.progress = None
            slot.progress_at = None
            slot.jobs_served += 1
            slot.idle_since = now
        return job

    # --- views -------------------------------------------------------------------

    def _slots(self, model: str = "") -> list[WorkerSlot] | dict:
        """Every slot, or those of ``model``."""
        return self.models.slots_of(model) if model else self.workers.values()

    def idle_slots(self, model: str = "") -> list[WorkerSlot]:
        """The slots a job (of ``model``; "": any) can get now: idle and not
        draining."""
        return [w for w in self._slots(model) if w.state == IDLE and not w.draining]

    def free_slots(self, model: str = "") -> int:
        return sum(
            1 for w in self._slots(model) if w.state == IDLE and not w.draining
        )

    def live_slots(self, model: str = "") -> int:
        """Slots that are registered and loaded (what "whole" is measured against)."""
        return sum(1 for w in self._slots(model)
                   if w.state not in (LOADING, FAILED))

    def busy_slots(self) -> int:
        return sum(1 for w in self.workers.values() if w.state in (BUSY, CANCELLING))

    def kv_cache_usage(self) -> float:
        """Mean KV-cache fill of the busy slots (0.0 when none is busy)."""
        levels = [
            min(1.0, (w.progress.n_ctx_used if w.progress else 0) / w.info.n_ctx)
            for w in self.workers.values()
            if w.state in (BUSY, CANCELLING) and w.info.n_ctx > 0
        ]
        return sum(levels) / len(levels) if levels else 0.0

    def record_progress(self, slot: WorkerSlot, progress: JobProgress,
                        now: float) -> None:
        """A heartbeat's progress for the slot's current job."""
        slot.progress = progress
        slot.progress_at = now

    def retry_after_s(self, now: float, model: str = "") -> float:
        """Estimate when a slot (of ``model``; "": any) frees up, from what
        its busy slots are doing: another model's slots free nothing for it.

        The slot expected to be free soonest sets the hint:

        * generating: its remaining tokens over its current speed;
        * paused because its client is not reading (no credit): the time left
          until the worker's stall timeout ends the job. Its speed says
          nothing while it waits, and it may wait for a minute (a hint of 1 s
          sent every client of a pool of slow readers straight back);
        * cancelling: about now (it stops at its next token).

        Each estimate counts down from the heartbeat it came from. Slots with
        no estimate yet (no heartbeat, no speed) are left out; with none at
        all the minimum is used. Bounded by ``RETRY_AFTER_MIN_S`` and
        ``RETRY_AFTER_MAX_S`` (``protocol.timing``) and rounded up.
        """
        estimates = []
        for slot in self._slots(model):
            if slot.state == CANCELLING:
                estimates.append(0.0)
                continue
            p = slot.progress
            if p is None or slot.state != BUSY:
                continue
            age = 0.0 if slot.progress_at is None else max(0.0,
                                                           now - slot.progress_at)
            if p.pause_ends_in_s is not None:
                estimates.append(p.pause_ends_in_s - age)
                continue
            remaining = p.max_tokens - p.n_generated
            if p.tokens_per_s > 0 and remaining >= 0:
                estimates.append(remaining / p.tokens_per_s - age)
        hint = min(estimates) if estimates else timing.RETRY_AFTER_MIN_S
        hint = max(timing.RETRY_AFTER_MIN_S, min(timing.RETRY_AFTER_MAX_S, hint))
        return float(math.ceil(hint))

    def snapshot(self, now: float, counters: dict[str, int],
                 stats: PoolTotals) -> PoolStatus:
        """The STATUS reply: this ledger, plus the broker's ``counters`` and
        ``stats`` (no prompt text: the ledger never has any)."""
        wall_now = time.time()
        slots = [
            SlotStatus(
                id=w.slot_id,
                state=w.state,
                id_task=w.job_id,
                worker_name=w.info.worker_name,
                host=w.info.host,
                pid=w.info.pid,
                model=w.info.model,
                engine=w.info.engine,
                n_ctx=w.info.n_ctx,
                lease_age_s=None if w.lease_taken_at is None
                else now - w.lease_taken_at,
                # The ledger runs on the monotonic clock; this converts for
                # humans.
                lease_taken_at=None if w.lease_taken_at is None
                else wall_now - (now - w.lease_taken_at),
                jobs_served=w.jobs_served,
                progress=w.progress,
                prompt_cache=w.prompt_cache,
                gpu=w.info.gpu,
                failure=w.failure,
                repack=w.info.repack,
                defaults=w.info.defaults,
            )
            for w in sorted(self.workers.values(), key=lambda w: w.slot_id)
        ]
        return PoolStatus(
            slots=slots,
            slots_total=self.live_slots(),
            slots_loading=len(self.workers) - self.live_slots(),
            slots_busy=self.busy_slots(),
            slots_free=self.free_slots(),
            kv_cache_usage_level=self.kv_cache_usage(),
            jobs=len(self.jobs),
            frontends=len(self.frontends),
            counters=counters,
            stats=stats,
            retry_after_s=self.retry_after_s(now),
            models=self.models.statuses(),
        )
