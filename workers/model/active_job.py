"""The job a model worker runs, as both its threads see it.

``ActiveJob`` is the engine's ``JobSink`` in the main thread (frames,
credit, progress, the thread budget it decodes with) and, in the link
thread, the job the broker gave us (cancel, credit, heartbeat progress).
``ThreadBudget`` is what ``--threads auto`` last heard from the broker.
``Outgoing`` is what the main thread hands the link: a message and the job
it belongs to, so the link forwards a job's frame only while that job is
still the one the broker believes we run (``workers.model.worker_link``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from protocol import messages
from protocol.payloads import JobProgress
from workers.model.settings import WorkerSettings

log = logging.getLogger("llamapool.worker")


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    """``--threads auto``: the thread count the broker last gave this worker
    (THREADS), when it arrived, and its sequence number (each budget is
    confirmed to the broker once, with THREADS_SET). ``broker_seq``: the
    THREADS' own sequence number, which THREADS_SET echoes."""

    n_threads: int
    told_at: float = 0.0
    seq: int = 0
    broker_seq: int = 0


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
        # The worker's own defaults (``--n-predict``, ``--temp``, ...) for
        # what the client left out: here, before either engine sees it.
        self.request = settings.request_defaults.fill(submit.request)
        #: The frontend's span for the job (None: not traced).
        self.trace_context = submit.trace
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
        #: Time spent waiting for credit, and how many waits (for its trace).
        self.paused_s = 0.0
        self.pauses = 0
        #: The worker's current thread budget, when it arrived and its
        #: sequence number (None: fixed --threads).
        self._wanted_threads = wanted_threads
        #: Threads the engine decodes with now (0: not reported yet).
        self._threads_in_use = 0
        #: The last budget (sequence number) confirmed to the broker.
        self._confirmed_budget = -1
        #: Called (in the link thread) after a cancel or new credit: a
        #: batched worker's decode loop, which never blocks on one job's
        #: credit, waits on it when every job it runs is paused.
        self.on_change: Callable[[], None] | None = None

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
        if self.on_change is not None:
            self.on_change()

    def add_credit(self, frames: int) -> None:
        with self._credit_changed:
            self._credit += max(0, frames)
            self._credit_changed.notify_all()
        if self.on_change is not None:
            self.on_change()

    # --- JobSink, called by the engine in the main thread ------------------------

    def emit(self, text: str, n_tokens: int, logprobs=(), timings=None,
             token_ids: bytes = b"") -> None:
        with self._credit_changed:
            self._credit -= 1
        self._send(messages.Token(self.job_id, text, n_tokens, list(logprobs),
                                  timings, token_ids=token_ids))

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
                        self._confirm_budget(self._wanted_threads())
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.stalled = True
                        return False
                    self._credit_changed.wait(remaining)
            finally:
                if self._paused_since is not None:
                    self.paused_s += time.monotonic() - self._paused_since
                    self.pauses += 1
                self._paused_since = None
        return not self._cancelled.is_set()

    def poll_credit(self, now: float) -> bool | None:
        """``wait_for_credit`` that never blocks, for a decode loop that runs
        other jobs meanwhile: True: a frame may go; None: paused, within the
        stall timeout (heartbeats say so, as they do for a blocked wait);
        False: give up (cancelled, or stalled past the timeout)."""
        with self._credit_changed:
            cancelled = self._cancelled.is_set()
            if self._credit > 0 or cancelled:
                self._end_pause(now)
                return not cancelled
            if self._paused_since is None:
                self._paused_since = now
            elif now - self._paused_since >= self._stall_timeout_s:
                self.stalled = True
                self._end_pause(now)
                return False
            return None

    def pause_ends_at(self) -> float | None:
        """When a paused job's stall timeout runs out (monotonic); None
        while it is not paused."""
        since = self._paused_since
        return None if since is None else since + self._stall_timeout_s

    def _end_pause(self, now: float) -> None:
        if self._paused_since is not None:
            self.paused_s += now - self._paused_since
            self.pauses += 1
            self._paused_since = None

    def _confirm_budget(self, budget: ThreadBudget | None) -> None:
        """Tell the broker that ``budget`` is in force from the next decode
        on (it may be holding a new job until we step down:
        ``workers.broker.step_down``), once per budget."""
        if budget is not None and budget.seq != self._confirmed_budget:
            self._confirmed_budget = budget.seq
            self._send(messages.ThreadsSet(budget.n_threads, budget.broker_seq))

    def in_force_at_once(self, n_threads: int) -> bool:
        """Called by the link thread once it has stored a new budget of
        ``n_threads``: whether that budget is in force already, so that the
        link confirms it now rather than the decode loop after its current
        token. It is when the job is paused (it applies the budget before it
        decodes again), and when the decode running now (or the next one,
        its count already chosen) uses no more threads than that: a survivor
        told to step up and, before its next token, back down again never
        took the higher count, and the broker need not hold the new job's
        SUBMIT for a token it decodes as it was.

        The job publishes ``paused`` and its count, then reads the budget
        (again); the link stores the budget, then reads them: one of the two
        sees the other's write, so a count above the new budget is never
        confirmed early."""
        return self.paused or self._threads_in_use <= n_threads

    def threads_to_use(self, current: int) -> int:
        # The engine applies the answer right after this returns, before its
        # next decode.
        started = self._threads_in_use != 0
        while True:
            budget = self._wanted_threads()
            n = current if budget is None else budget.n_threads
            # Published before the budget is read again: ``in_force_at_once``.
            self._threads_in_use = n
            if self._wanted_threads() is budget:
                break
        self._confirm_budget(budget)
        if budget is not None:
            told_at = budget.told_at
            if n != current:
                # How long the host was oversubscribed (or under-used): the
                # decode that was running when THREADS arrived.
                # (tests/bench/bench_thread_stepdown.py reads this line.)
                log.debug("job %s: threads %d -> %d %s, %.1f ms after THREADS",
                          self.job_id, current, n,
                          "mid-job" if started else "at its start",
                          (time.monotonic() - told_at) * 1000)
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


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """A message the main thread hands to the link thread, tagged with the
    job it belongs to (None: it is about the worker, such as CACHE_REPORT).

    The tag is the job object, not its id: the link forwards a job's frame
    only while that very job is the one the broker gave us.
    """

    job: ActiveJob | None
    message: messages.Message
