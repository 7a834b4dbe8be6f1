"""Pool-wide counters, kept by the broker because every job's end passes it.

The frontends' ``/metrics`` render these (as ``llama_*`` series, matching
llama.cpp's server names), so the numbers cover the whole pool however many
frontend processes and hosts there are. They reset when the broker restarts,
which Prometheus handles as a counter reset.
"""

from __future__ import annotations

import bisect
import collections
import time

from protocol import messages
from protocol.messages import FinishReason
from protocol.payloads import HistogramSnapshot, PoolTotals

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


class PoolStats:
    """Totals over every job the broker has seen end."""

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
        self.started_at_unix = time.time()

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

    def job_lost(self) -> None:
        """A job whose worker died: it never sent a terminal frame."""
        self.request_fail += 1

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
        )
