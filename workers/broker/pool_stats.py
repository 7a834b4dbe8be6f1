"""Pool-wide counters, kept by the broker because every job's end passes it.

The frontends' ``/metrics`` render these (as ``llama_*`` series, matching
llama.cpp's server names), so the numbers cover the whole pool however many
frontend processes and hosts there are. They reset when the broker restarts,
which Prometheus handles as a counter reset.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time

from protocol import limits, messages
from protocol.messages import FinishReason
from protocol.payloads import HistogramSnapshot, ModelTotals, PoolTotals

#: Buckets (seconds) for disconnect-to-release latency.
RELEASE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)


#: How long a job waited for a slot (``--queue-max``), seconds.
QUEUE_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Newest observations kept for p50/max and per-run figures.
RECENT_WINDOW = 256


class FixedHistogram:
    """A Prometheus-style histogram; ``snapshot()`` is what STATUS carries."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0
        # Every STATUS reply (each /health, /slots, /metrics) sorts these in
        # the broker's only thread, so keep the window small.
        self.recent: collections.deque[float] = collections.deque(
            maxlen=RECENT_WINDOW)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self.recent.append(value)

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        recent = sorted(self.recent)
        return HistogramSnapshot(
            buckets=list(self.buckets),
            cumulative=cumulative,
            sum=self.sum,
            count=self.count,
            p50=recent[len(recent) // 2] if recent else None,
            max=recent[-1] if recent else None,
            recent=list(self.recent),
        )


class JobCounts:
    """Totals over the jobs of one model (or of the whole pool)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.tokens_generated = 0
        self.request_success = 0
        self.request_fail = 0
        self.prompt_seconds = 0.0
        self.tokens_seconds = 0.0
        self.cancelled = 0
        self.release_after_cancel = FixedHistogram(RELEASE_BUCKETS_S)
        self.queue_wait = FixedHistogram(QUEUE_WAIT_BUCKETS_S)
        self.n_tokens_max = 0
        self.n_decode = 0
        #: NO_SLOT answers, jobs that waited, and waits that ended without a
        #: slot (the pool's own are ``BrokerCounters``' fields of these names).
        self.no_slot = 0
        self.queued = 0
        self.queue_full = 0
        self.queue_expired = 0
        self.queue_left = 0

    def job_ended(self, msg: messages.Message, cancel_requested_at: float | None,
                  now: float) -> None:
        if isinstance(msg, messages.Final):
            # Typed and range-checked on decode (``protocol.payloads``).
            self.prompt_tokens += msg.timings.prompt_n
            self.prompt_tokens_cached += msg.usage.cached_tokens
            self.tokens_generated += msg.usage.completion_tokens
            self.prompt_seconds += msg.timings.prompt_ms / 1000
            self.tokens_seconds += msg.timings.predicted_ms / 1000
            self.n_tokens_max = max(self.n_tokens_max, msg.usage.total_tokens)
            # Each worker decodes one sequence at a time: the prompt's
            # computed part in one evaluation (llama.cpp splits it into
            # n_batch batches inside, which the FINAL does not report), then
            # one per generated token.
            self.n_decode += (msg.timings.prompt_n > 0) + msg.usage.completion_tokens
            if msg.finish_reason == FinishReason.CANCELLED:
                self.cancelled += 1
            else:
                self.request_success += 1
        else:
            self.request_fail += 1
        if cancel_requested_at is not None:
            self.release_after_cancel.observe(now - cancel_requested_at)

    def model_totals(self, name: str) -> ModelTotals:
        """These counts as one model's record (histograms without their
        recent observations, which only the pool's figures use)."""
        def bare(hist: FixedHistogram) -> HistogramSnapshot:
            return dataclasses.replace(hist.snapshot(), p50=None, max=None,
                                       recent=[])
        return ModelTotals(
            name=name,
            prompt_tokens_total=self.prompt_tokens,
            prompt_tokens_cached_total=self.prompt_tokens_cached,
            tokens_generated_total=self.tokens_generated,
            request_success_total=self.request_success,
            request_fail_total=self.request_fail,
            request_cancelled_total=self.cancelled,
            prompt_seconds_total=self.prompt_seconds,
            tokens_seconds_total=self.tokens_seconds,
            n_tokens_max=self.n_tokens_max,
            n_decode_total=self.n_decode,
            cancel_release_s=bare(self.release_after_cancel),
            queue_wait_s=bare(self.queue_wait),
            no_slot=self.no_slot, queued=self.queued, queue_full=self.queue_full,
            queue_expired=self.queue_expired, queue_left=self.queue_left)


class PoolStats(JobCounts):
    """Totals over every job the broker has seen end, and each model's share
    (issue 30: ``/metrics`` labels a model's series with its name).

    A job's model is its worker's (``ledger.Job.model``). The models kept
    are bounded by ``limits.MAX_MODELS``: a model's totals outlive its
    workers (a counter must not drop while a model restarts), and beyond the
    bound the one whose jobs ended longest ago is forgotten, which
    Prometheus reads as the end of its series.
    """

    def __init__(self) -> None:
        super().__init__()
        self.started_at_unix = time.time()
        self._models: collections.OrderedDict[str, JobCounts] = (
            collections.OrderedDict())

    def of(self, model: str) -> JobCounts:
        """``model``'s totals (made on first use; the newest-used last)."""
        counts = self._models.get(model)
        if counts is None:
            counts = self._models[model] = JobCounts()
            while len(self._models) > limits.MAX_MODELS:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(model)
        return counts

    def job_ended(self, msg: messages.Message, cancel_requested_at: float | None,
                  now: float, model: str = "") -> None:
        super().job_ended(msg, cancel_requested_at, now)
        self.of(model).job_ended(msg, cancel_requested_at, now)

    def job_lost(self, model: str = "") -> None:
        """A job whose worker died: it never sent a terminal frame."""
        self.request_fail += 1
        self.of(model).request_fail += 1

    def waited(self, model: str, seconds: float) -> None:
        """A job of ``model`` got a slot after waiting ``seconds``."""
        self.queue_wait.observe(seconds)
        self.of(model).queue_wait.observe(seconds)

    def totals(self) -> PoolTotals:
        return PoolTotals(
            prompt_tokens_total=self.prompt_tokens,
            tokens_generated_total=self.tokens_generated,
            request_success_total=self.request_success,
            request_fail_total=self.request_fail,
            request_cancelled_total=self.cancelled,
            prompt_seconds_total=self.prompt_seconds,
            tokens_seconds_total=self.tokens_seconds,
            cancel_release_s=self.release_after_cancel.snapshot(),
            prompt_tokens_cached_total=self.prompt_tokens_cached,
            n_tokens_max=self.n_tokens_max,
            n_decode_total=self.n_decode,
            started_at_unix=self.started_at_unix,
            queue_wait_s=self.queue_wait.snapshot(),
            models=[counts.model_totals(name)
                    for name, counts in sorted(self._models.items())],
        )
