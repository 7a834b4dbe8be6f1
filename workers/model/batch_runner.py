"""A batched worker's main thread: one decode loop for all its slots.

``BatchRunner`` owns the ``BatchedEngine`` (``workers.model.batched_engine``)
and its one llama.cpp context; no other thread touches it. Each slot's link
thread (one ``WorkerLink`` per slot, ``workers.model.batched_worker``) hands
its SUBMIT over through that slot's ``SlotPort``; cancel and credit reach the
``ActiveJob`` directly, as in a one-slot worker, and wake this loop
(``ActiveJob.on_change``).

Each turn of the loop, as llama-server's ``update_slots``:

1. jobs handed over since the last step join (prompt tokenised, sampler
   made; a refused one ends at once with its ERROR);
2. the step is planned: every generating slot that may send a frame
   contributes the token it sampled last; then slots still prefilling get
   prompt chunks in the room left, at most ``n_batch`` tokens in all. A
   slot paused for credit sits the step out (heartbeats say it is paused),
   a cancelled or stalled one ends;
3. one ``llama_decode`` for the step, then each slot with an output samples
   with its own chain and handles its token (text, stop strings, budget).

A slot's job ends with its terminal frame, sent by its own link, after its
sequence was emptied: the broker may give that slot a new job at once.
With nothing to decode (no job, or every job paused) the loop waits for a
hand-over, credit or cancel, or the nearest stall deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from protocol import messages, worker_phase
from protocol.errors import ErrorCode
from protocol.lifecycle import StopSignal
from protocol.messages import FinishReason
from workers.model import crash_on_demand
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.batch_slots import SlotJob
from workers.model.batched_engine import BatchedEngine
from workers.model.crash_on_demand import crash_if_asked
from workers.model.engine import GenerationResult, RequestRejected
from workers.model.features import refuse_unsupported
from workers.model.job_runner import JobRunner
from workers.model.settings import WorkerSettings
from workers.model.token_loop import cancelled_while_tokenizing
from workers.model.tokenizing import TokenizeCancelled
from workers.model.tracing import job_ended, job_trace

log = logging.getLogger("llamapool.worker")

#: Longest wait with nothing to decode: how soon a stop is seen.
IDLE_WAIT_S = 0.2


class SlotPort:
    """What one slot's ``WorkerLink`` sees as its runner: the engine (for
    READY), the cache report (none), and ``submit`` into this slot."""

    def __init__(self, runner: BatchRunner, seq: int) -> None:
        self._runner = runner
        self.seq = seq
        #: The slot's link's ``send`` (set once the link exists).
        self.send: Callable[[Outgoing], None] | None = None

    @property
    def engine(self) -> BatchedEngine | None:
        return self._runner.engine

    @property
    def cache_report(self) -> None:
        return None

    def submit(self, job: ActiveJob) -> None:
        self._runner.submit_to(self.seq, job)


class BatchRunner(JobRunner):
    """Runs every slot's job through one batched engine, in the main thread
    (loading and warm-up as a one-slot ``JobRunner``)."""

    def __init__(self, settings: WorkerSettings,
                 load_engine: Callable[[], BatchedEngine]) -> None:
        super().__init__(settings, load_engine, send=_no_worker_messages)
        self.ports = [SlotPort(self, seq) for seq in range(settings.n_slots)]
        self._incoming: queue.Queue[tuple[int, ActiveJob]] = queue.Queue()
        #: Set by a hand-over, credit or cancel: the loop looks again.
        self._wake = threading.Event()
        #: The running jobs, by slot (sequence id).
        self._active: dict[int, SlotJob] = {}
        self._traces: dict[int, object] = {}

    def submit_to(self, seq: int, job: ActiveJob) -> None:
        """Hand a job to slot ``seq`` (from that slot's link thread)."""
        job.on_change = self._wake.set
        self._incoming.put((seq, job))
        self._wake.set()

    def submit(self, job: ActiveJob) -> None:
        raise TypeError("a batched worker's jobs go to a slot: submit_to")

    def run(self, stop: StopSignal) -> None:
        """Load the engine, then decode until ``stop`` is set and every
        running job has ended (jobs handed over after the stop end with
        WORKER_SHUTDOWN; the links cancel the rest at the grace's end).

        Raises:
            EngineLoadError: the model did not load, or its warm-up failed.
        """
        self.engine = self._load_and_warm_up()
        self._phase.set(worker_phase.IDLE)
        while not stop.is_set() or self._active:
            self._wake.clear()  # before looking: a wake-up after it counts
            self._admit(stopping=stop.is_set())
            entries = self._plan(time.monotonic())
            if entries:
                self._step(entries)
            else:
                self._wait()
        self._admit(stopping=True)

    # --- joining ------------------------------------------------------------------

    def _admit(self, stopping: bool) -> None:
        while True:
            try:
                seq, job = self._incoming.get_nowait()
            except queue.Empty:
                return
            if stopping:
                job.ended_by_shutdown = True
            self._join(seq, job)

    def _join(self, seq: int, job: ActiveJob) -> None:
        trace = job_trace(job)
        job_ended()  # several jobs run at once: no hook notes into "current"
        if trace is not None:
            self._traces[seq] = trace
        started = time.perf_counter()
        try:
            crash_if_asked(crash_on_demand.JOB)
            if job.ended_by_shutdown:
                raise RequestRejected(ErrorCode.WORKER_SHUTDOWN,
                                      "the worker is shutting down")
            refuse_unsupported(job.request, self.engine.name, self.engine.features)
            slot = self.engine.start(seq, job)
        except RequestRejected as exc:
            self._send_end(seq, job, messages.Error(
                job.job_id, exc.code, exc.message, exc.n_prompt_tokens, exc.n_ctx))
            return
        except TokenizeCancelled:
            self._send_end(seq, job, self._terminal(
                job, cancelled_while_tokenizing(started)))
            return
        except Exception:
            log.exception("job %s failed to start in the engine", job.job_id)
            self._send_end(seq, job, messages.Error(
                job.job_id, ErrorCode.ENGINE_ERROR, "generation failed"))
            return
        self._active[seq] = slot
        self.busy = True
        self._show_phase()
        if slot.max_tokens <= 0:
            self._end(slot, FinishReason.LENGTH)

    # --- one step -----------------------------------------------------------------

    def _plan(self, now: float) -> list[tuple[SlotJob, list[int], bool]]:
        """This step's entries: (slot, tokens, logits wanted); slots that
        must end (cancelled, stalled) end here."""
        room = self.engine.n_batch
        entries = []
        generating = [s for s in self._active.values() if not s.prefilling]
        prefilling = [s for s in self._active.values() if s.prefilling]
        for slot in generating:
            if self._may_emit(slot, now):
                entries.append((slot, [slot.pending], True))
                room -= 1
        for slot in prefilling:
            if room <= 0:
                break
            if slot.job.should_stop():
                self._end(slot, FinishReason.CANCELLED)
                continue
            chunk, last = slot.prompt_chunk(room)
            if last and not self._may_emit(slot, now):
                # Its first token could not go out: all but the last prompt
                # token now, the rest once the client reads again.
                chunk, last = chunk[:-1], False
                if not chunk:
                    continue
            entries.append((slot, chunk, last))
            room -= len(chunk)
        return entries

    def _may_emit(self, slot: SlotJob, now: float) -> bool:
        """Whether the slot may take part in a step that samples for it;
        a cancelled or stalled one ends."""
        verdict = slot.job.poll_credit(now)
        if verdict is False:
            self._end(slot, FinishReason.CANCELLED)
        return verdict is True

    def _step(self, entries: list[tuple[SlotJob, list[int], bool]]) -> None:
        try:
            indices = self.engine.decode(entries)
        except Exception as exc:
            log.exception("a batched decode of %d slots failed", len(entries))
            for slot, _, _ in entries:
                self._fail(slot, exc)
            return
        for (slot, _, wants_logits), index in zip(entries, indices, strict=True):
            if not wants_logits:
                continue
            try:
                token = self.engine.sample(slot, index)
                finish = slot.take(token)
            except Exception as exc:
                log.exception("job %s failed in the engine", slot.job.job_id)
                self._fail(slot, exc)
                continue
            if finish is not None:
                self._end(slot, finish)

    def _wait(self) -> None:
        """Nothing to decode: wait for a hand-over, credit or cancel, or
        until the nearest paused job's stall deadline."""
        timeout = IDLE_WAIT_S
        now = time.monotonic()
        for slot in self._active.values():
            ends_at = slot.job.pause_ends_at()
            if ends_at is not None:
                timeout = min(timeout, max(0.0, ends_at - now))
        self._wake.wait(timeout)

    # --- ending ---------------------------------------------------------------------

    def _end(self, slot: SlotJob, finish: FinishReason) -> None:
        result = slot.result(finish)
        self.tokens_generated += result.completion_tokens
        self._release(slot)
        self._send_end(slot.seq, slot.job, self._terminal(slot.job, result))

    def _fail(self, slot: SlotJob, exc: Exception) -> None:
        self._release(slot)
        self._send_end(slot.seq, slot.job, messages.Error(
            slot.job.job_id, ErrorCode.ENGINE_ERROR, "generation failed"))

    def _release(self, slot: SlotJob) -> None:
        """Empty the slot's sequence before its terminal frame: the broker
        may hand the slot a new job as soon as it passes that frame on."""
        self._active.pop(slot.seq, None)
        slot.close()
        try:
            self.engine.release(slot.seq)
        except Exception:
            log.exception("emptying sequence %d failed", slot.seq)
        self.busy = bool(self._active)
        self._show_phase()

    @staticmethod
    def _terminal(job: ActiveJob, result: GenerationResult) -> messages.Message:
        """As ``JobRunner._generate`` ends a job: shutdown and stall are
        errors, anything else a FINAL."""
        if job.ended_by_shutdown:
            return messages.Error(job.job_id, ErrorCode.WORKER_SHUTDOWN,
                                  "the worker shut down before the job finished")
        if job.stalled:
            return messages.Error(
                job.job_id, ErrorCode.CLIENT_STALLED,
                "the client stopped reading; generation was cancelled")
        return messages.Final(
            job.job_id, result.finish_reason, result.usage(), result.timings(),
            result.tail_text, result.tail_logprobs, result.stopping_word,
            result.truncated, token_ids=result.tail_token_ids)

    def _send_end(self, seq: int, job: ActiveJob, msg: messages.Message) -> None:
        self.jobs_done += 1
        trace = self._traces.pop(seq, None)
        if trace is not None:
            trace.end(msg)
        self.ports[seq].send(Outgoing(job, msg))

    def _show_phase(self) -> None:
        """The phase file names every running job (a crash takes them all)."""
        ids = [s.job.job_id for s in self._active.values()]
        self._phase.set(worker_phase.job_phase(",".join(ids)) if ids
                        else worker_phase.IDLE)


def _no_worker_messages(out: Outgoing) -> None:
    """A batched engine keeps no prompt cache: nothing worker-wide to say
    but through a slot's link."""
    raise TypeError(f"a batched worker sent {type(out.message).__name__} "
                    "outside a slot")
