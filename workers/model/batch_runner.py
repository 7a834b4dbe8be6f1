"""A batched worker's main thread: one decode loop for all its slots.

``BatchRunner`` owns the ``BatchedEngine`` (``workers.model.batched_engine``)
and its one llama.cpp context; no other thread touches it. Each slot's link
thread (one ``WorkerLink`` per slot, ``workers.model.batched_worker``) hands
its SUBMIT over through that slot's ``SlotPort``; cancel and credit reach the
``ActiveJob`` directly, as in a one-slot worker, and wake this loop
(``ActiveJob.on_change``).

An embedding job holds its slot but never joins the batch: it runs in the
engine's embedding context on a thread of its own (one at a time, as that
context is one), and its end comes back to this loop, which sends it.

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

A slot's job ends with its CACHE_REPORT (what its sequence and the
worker's saved states hold now) and then its terminal frame, both sent by
its own link: the broker may give that slot a new job at once, routed by
what the report says. With nothing to decode (no job, or every job paused)
the loop first saves the sequences of idle slots into the prompt-state
cache, as a one-slot worker does between jobs, then waits for a hand-over,
credit or cancel, or the nearest stall deadline.
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
from protocol.payloads import EMBEDDING
from workers.model import crash_on_demand
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.batch_slots import SlotJob
from workers.model.batched_engine import BatchedEngine
from workers.model.crash_on_demand import crash_if_asked
from workers.model.engine import GenerationResult, RequestRejected
from workers.model.features import refuse_unsupported
from workers.model.job_runner import JobRunner
from workers.model.settings import WorkerSettings
from workers.model.slot_files import SlotTask
from workers.model.token_loop import cancelled_while_tokenizing
from workers.model.tokenizing import TokenizeCancelled
from workers.model.tracing import job_ended, job_trace

log = logging.getLogger("llamapool.worker")

#: Longest wait with nothing to decode: how soon a stop is seen.
IDLE_WAIT_S = 0.2


class SlotPort:
    """What one slot's ``WorkerLink`` sees as its runner: the engine (for
    READY), the slot's last CACHE_REPORT, and ``submit`` into this slot."""

    def __init__(self, runner: BatchRunner, seq: int) -> None:
        self._runner = runner
        self.seq = seq
        #: The slot's link's ``send`` (set once the link exists).
        self.send: Callable[[Outgoing], None] | None = None
        #: The last CACHE_REPORT this slot sent (replaced whole; read by
        #: its link for a READY to a new broker, and by metrics).
        self.cache_report: messages.CacheReport | None = None

    @property
    def engine(self) -> BatchedEngine | None:
        return self._runner.engine

    def submit(self, job: ActiveJob) -> None:
        self._runner.submit_to(self.seq, job)

    def submit_slot_action(self, task: SlotTask) -> None:
        self._runner.submit_to(self.seq, task)


class BatchRunner(JobRunner):
    """Runs every slot's job through one batched engine, in the main thread
    (loading and warm-up as a one-slot ``JobRunner``)."""

    def __init__(self, settings: WorkerSettings,
                 load_engine: Callable[[], BatchedEngine]) -> None:
        super().__init__(settings, load_engine, send=_no_worker_messages)
        self.ports = [SlotPort(self, seq) for seq in range(settings.n_slots)]
        self._incoming: queue.Queue[tuple[int, ActiveJob | SlotTask]] = (
            queue.Queue())
        #: Set by a hand-over, credit or cancel: the loop looks again.
        self._wake = threading.Event()
        #: The running jobs, by slot (sequence id).
        self._active: dict[int, SlotJob] = {}
        self._traces: dict[int, object] = {}
        #: A job ended since idle slots' sequences were last saved.
        self._unsaved = False
        #: Embedding jobs running, by slot, and their ends, from their threads.
        self._embedding: dict[int, ActiveJob] = {}
        self._embedded: queue.Queue[tuple[int, ActiveJob, messages.Message]] = (
            queue.Queue())
        self._embedder_lock = threading.Lock()

    def submit_to(self, seq: int, job: ActiveJob | SlotTask) -> None:
        """Hand a job or a slot action to slot ``seq`` (from that slot's
        link thread)."""
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
        while not stop.is_set() or self._active or self._embedding:
            self._wake.clear()  # before looking: a wake-up after it counts
            self._collect_embeddings()
            self._admit(stopping=stop.is_set())
            entries = self._plan(time.monotonic())
            if entries:
                self._step(entries)
            elif self._unsaved and self._incoming.empty():
                self._use_idle_time()
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
            if isinstance(job, SlotTask):
                self._run_slot_action(seq, job)
            else:
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
            if job.request.kind == EMBEDDING:
                self._start_embedding(seq, job)
                return
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
        self._set_busy()
        if slot.max_tokens <= 0:
            self._end(slot, FinishReason.LENGTH)

    def _run_slot_action(self, seq: int, task: SlotTask) -> None:
        """A slot action on slot ``seq``'s sequence, between two steps (the
        broker leased the slot for it: no job runs there)."""
        done = self.slot_files.run(task, _OneSlot(self.engine, seq))
        self._send_cache_report(seq)
        self.ports[seq].send(Outgoing(task, done))

    # --- embeddings, beside the batch ---------------------------------------------

    def _start_embedding(self, seq: int, job: ActiveJob) -> None:
        self._embedding[seq] = job
        self._set_busy()
        threading.Thread(target=self._embed, args=(seq, job),
                         name=f"embedding-{seq}", daemon=True).start()

    def _embed(self, seq: int, job: ActiveJob) -> None:
        """An embedding job's thread: run it in the embedding context (a
        credit wait blocks only this thread) and hand its end to the loop."""
        started = time.perf_counter()
        try:
            with self._embedder_lock:
                result = self.engine.embedder.run(job.request, job)
            msg = self._terminal(job, result)
        except RequestRejected as exc:
            msg = messages.Error(job.job_id, exc.code, exc.message,
                                 exc.n_prompt_tokens, exc.n_ctx)
        except TokenizeCancelled:
            msg = self._terminal(job, cancelled_while_tokenizing(started))
        except Exception:
            log.exception("embedding job %s failed", job.job_id)
            msg = messages.Error(job.job_id, ErrorCode.ENGINE_ERROR,
                                 "generation failed")
        self._embedded.put((seq, job, msg))
        self._wake.set()

    def _collect_embeddings(self) -> None:
        while True:
            try:
                seq, job, msg = self._embedded.get_nowait()
            except queue.Empty:
                return
            self._embedding.pop(seq, None)
            self._set_busy()
            self._send_cache_report(seq)
            self._send_end(seq, job, msg)

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
            except RequestRejected as exc:  # its grammar passed its budget
                self._release(slot)
                self._send_end(slot.seq, slot.job, messages.Error(
                    slot.job.job_id, exc.code, exc.message))
                continue
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
        self._release(slot, forget=True)
        self._send_end(slot.seq, slot.job, messages.Error(
            slot.job.job_id, ErrorCode.ENGINE_ERROR, "generation failed"))

    def _release(self, slot: SlotJob, forget: bool = False) -> None:
        """The slot is free: its sequence stays for the next job to reuse
        (emptied if ``forget``: a failed decode left it unknown), and its
        CACHE_REPORT goes before its terminal frame, since the broker may
        route the slot's next job as soon as it passes that frame on."""
        self._active.pop(slot.seq, None)
        slot.close()
        if forget:
            try:
                self.engine.forget(slot.seq)
            except Exception:
                log.exception("emptying sequence %d failed", slot.seq)
        self._unsaved = True
        self._set_busy()
        self._send_cache_report(slot.seq)

    def _use_idle_time(self) -> None:
        """Nothing to decode: save idle slots' sequences (which the next job
        that moves away from one would otherwise save in its own time to
        first token); every slot reports the cache's new states."""
        self._unsaved = False
        idle = [seq for seq in range(len(self.ports))
                if seq not in self._active and seq not in self._embedding]
        try:
            changed = self.engine.save_idle(idle)
        except Exception:  # the worker serves on; the next job saves lazily
            log.exception("saving idle slots' sequences failed")
            return
        if changed:
            for seq in range(len(self.ports)):
                self._send_cache_report(seq)

    def _send_cache_report(self, seq: int) -> None:
        try:
            states, status = self.engine.report(seq)
        except Exception:  # never lose the job's terminal frame over it
            log.exception("building slot %d's prompt-cache report failed", seq)
            return
        port = self.ports[seq]
        port.cache_report = messages.CacheReport(states, status)
        port.send(Outgoing(None, port.cache_report))

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

    def _set_busy(self) -> None:
        """``busy`` and the phase file: the phase names every running job
        (a crash takes them all)."""
        self.busy = bool(self._active or self._embedding)
        ids = [s.job.job_id for s in self._active.values()]
        ids += [job.job_id for job in self._embedding.values()]
        self._phase.set(worker_phase.job_phase(",".join(ids)) if ids
                        else worker_phase.IDLE)


class _OneSlot:
    """What ``SlotFiles.run`` acts on: one slot's sequence and the saved
    states it shares with the worker's other slots."""

    def __init__(self, engine: BatchedEngine, seq: int) -> None:
        self.slot_reuse = engine.reuse[seq]


def _no_worker_messages(out: Outgoing) -> None:
    """Every message of a batched worker goes through a slot's link."""
    raise TypeError(f"a batched worker sent {type(out.message).__name__} "
                    "outside a slot")
