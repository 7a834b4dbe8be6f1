"""The model worker's main thread: the engine, and the jobs it runs.

It loads the model and proves it computes, then takes each job the link
thread hands over (``submit``), runs it through the engine, and gives the
engine its idle time between jobs. It touches no socket: everything it
says to the broker goes through ``send`` as an ``Outgoing``, tagged with
the job it belongs to, and the link thread decides what goes out
(``workers.model.worker_link``).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from protocol import messages, worker_phase
from protocol.errors import ErrorCode
from protocol.lifecycle import StopSignal
from workers.model import crash_on_demand
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.crash_on_demand import crash_if_asked
from workers.model.engine import Engine, RequestRejected
from workers.model.features import refuse_unsupported
from workers.model.settings import WorkerSettings
from workers.model.slot_files import SlotFiles, SlotTask
from workers.model.tracing import job_ended, job_trace

log = logging.getLogger("llamapool.worker")


class EngineLoadError(RuntimeError):
    """The model (engine) could not be loaded; the worker cannot serve."""


class JobRunner:
    """Runs one job at a time through one engine, in the main thread."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], Engine],
        send: Callable[[Outgoing], None],
    ) -> None:
        self._load_engine = load_engine
        self._send = send
        #: None until the model has loaded (the link says LOADING until
        #: then, and READY after).
        self.engine: Engine | None = None
        # A queue.Queue, not a SimpleQueue: the main thread's timed get is
        # where SIGTERM lands, and CPython 3.11's SimpleQueue waits forever
        # if a handler returns after the deadline (tests/test_interrupted_waits.py).
        self._jobs: queue.Queue[ActiveJob] = queue.Queue()
        #: What this process is doing, for whoever sees it crash.
        self._phase = worker_phase.PhaseFile(settings.phase_file)
        #: Other names of this model (a job names the model by its name).
        self._aliases = frozenset(settings.alias_list)
        self.jobs_done = 0
        self.tokens_generated = 0
        self.busy = False
        #: The last CACHE_REPORT built (replaced whole; read by the link
        #: thread, for a READY to a new broker, and by metrics).
        self.cache_report: messages.CacheReport | None = None
        #: llama-server's slot actions (``--slot-save-path``); raises
        #: ``ConfigError`` if the directory cannot be made.
        self.slot_files = SlotFiles(settings.slot_save_path)

    def submit(self, job: ActiveJob) -> None:
        """Hand a job over (from the link thread)."""
        self._jobs.put(job)

    def submit_slot_action(self, task: SlotTask) -> None:
        """Hand a slot action over (from the link thread): it runs in turn
        with jobs, in this thread, which owns the KV cache. A runner without
        this method has no slot actions (the link says so)."""
        self._jobs.put(task)

    def run(self, stop: StopSignal) -> None:
        """Load the engine, then run jobs until ``stop`` is set; a job handed
        over just before the stop ends with WORKER_SHUTDOWN.

        Raises:
            EngineLoadError: see ``_load_and_warm_up``.
        """
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
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.ended_by_shutdown = True
            job.cancel()
            self._run_job(job)

    def close(self) -> None:
        self._phase.close()

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

    def _run_job(self, job: ActiveJob | SlotTask) -> None:
        if isinstance(job, SlotTask):
            self._run_slot_action(job)
            return
        self.busy = True
        trace = job_trace(job)  # None when tracing is off or the job untraced
        self._phase.set(worker_phase.job_phase(job.job_id))
        try:
            msg = self._generate(job)
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
        if trace is not None:
            job_ended()
            trace.end(msg)
        self._send(Outgoing(job, msg))
        self._phase.set(worker_phase.IDLE)

    def _run_slot_action(self, task: SlotTask) -> None:
        self.busy = True
        self._phase.set(worker_phase.job_phase(task.job_id))
        done = self.slot_files.run(task, self.engine)
        self.busy = False
        if not done.code:
            log.info("slot %s: %d tokens, %d bytes in %.1f ms", task.action.action,
                     done.n_tokens, done.n_bytes, done.ms)
        # Before SLOT_DONE, as after a job: routing and /slots see the
        # restored or erased sequence when the slot is free again.
        self._send_cache_report()
        self._send(Outgoing(task, done))
        self._phase.set(worker_phase.IDLE)

    def _generate(self, job: ActiveJob) -> messages.Message:
        """Run ``job`` through the engine; its terminal frame.

        Raises:
            RequestRejected: the worker is stopping, or the engine cannot
                do what the request asks, or the engine refused it.
        """
        crash_if_asked(crash_on_demand.JOB)
        if job.ended_by_shutdown:
            raise RequestRejected(
                ErrorCode.WORKER_SHUTDOWN, "the worker is shutting down"
            )
        # The one check of what the engine can do: it never sees a request
        # that asks for more.
        refuse_unsupported(job.request, self.engine.name, self.engine.features)
        model = job.request.model
        if model and model != self.engine.model_name and model not in self._aliases:
            # A broker that routes by model never sends one (an older one
            # may): refused, not answered by the wrong model.
            raise RequestRejected(ErrorCode.MODEL_NOT_FOUND,
                                  f"this worker serves model "
                                  f"'{self.engine.model_name}', not '{model[:200]}'")
        result = self.engine.run(job.request, job)
        self.tokens_generated += result.completion_tokens
        if job.ended_by_shutdown:
            return messages.Error(
                job.job_id, ErrorCode.WORKER_SHUTDOWN,
                "the worker shut down before the job finished",
            )
        if job.stalled:
            return messages.Error(
                job.job_id, ErrorCode.CLIENT_STALLED,
                "the client stopped reading; generation was cancelled",
            )
        return messages.Final(
            job.job_id, result.finish_reason, result.usage(),
            result.timings(), result.tail_text, result.tail_logprobs,
            result.stopping_word, result.truncated,
            token_ids=result.tail_token_ids,
            # The format the frontend reads the calls in (an engine with no
            # chat template has none).
            tool_format=getattr(self.engine, "tool_format", "")
            if job.request.tools else "",
        )

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
        self._send(Outgoing(None, self.cache_report))
