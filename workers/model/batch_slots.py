"""One job in one slot of a batched worker, between decode steps.

A ``SlotJob`` is what the batched decode loop (``workers.model.batch_runner``)
keeps of a running job: its prompt and how much of it the slot's sequence
holds, the token it sampled last (decoded in the next step), its own
sampler chain, and its output. Each sampled token goes through what a
one-slot job's token loop does (``workers.model.token_loop``): the
end-of-generation check, incremental UTF-8-safe text, stop strings that
never leak, credit, progress for heartbeats, the budget and cancel.

Credit is never waited for here: the loop lets a slot into a step only when
one frame may go (``ActiveJob.poll_credit``), and a step samples at most one
token per slot, so the output's credit wait returns at once.
"""

from __future__ import annotations

import time

from protocol.messages import FinishReason
from workers.model.active_job import ActiveJob
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.engine import GenerationResult
from workers.model.job_sampling import token_taker
from workers.model.kv_sequence import SlotSequence
from workers.model.logits import RequestLogits
from workers.model.token_loop import LiveTimings, TokenOutput


class SlotJob:
    """A job in one sequence of the batched context.

    Args:
        sequence: the slot's sequence, holding ``cached_tokens`` of the
            prompt already (``prompt_reuse.PromptReuse.prepare``).
        job: the job, as both worker threads see it.
        prompt: its prompt tokens (never empty).
        stops: every stop string (the request's and the chat format's).
        max_tokens: tokens it may generate (``engine.token_budget``).
        sampler: its own sampler chain (``ShortlistSampler``), freed
            with ``close``.
        logits: its logits processors (``job_sampling.request_logits``),
            which ``sampler`` runs first; closed with ``close``.
        detok: its detokeniser (``job_sampling.job_detokenizer``).
        vocab: the model's vocabulary handle.
        started: ``time.perf_counter()`` when the job began.
        context_limited: ``max_tokens`` is the room the context had left.
    """

    def __init__(self, sequence: SlotSequence, job: ActiveJob, prompt: list[int],
                 stops: list[str], max_tokens: int, sampler,
                 logits: RequestLogits, detok: IncrementalDetokenizer, vocab,
                 started: float, *, cached_tokens: int = 0,
                 timings_per_token: bool = False,
                 context_limited: bool = False) -> None:
        self.sequence = sequence
        self.seq = sequence.seq
        self.cached_tokens = cached_tokens
        self.job = job
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.logits = logits
        self.started = started
        self.context_limited = context_limited
        #: The token sampled last, to be decoded in the next step (None
        #: while the prompt is still being decoded).
        self.pending: int | None = None
        self.detok = detok
        self._meaning = token_taker(vocab, logits, detok, self._context_used)
        live = (LiveTimings(started, len(prompt), cached_tokens)
                if timings_per_token else None)
        self.output = TokenOutput(job, stops, live, token_ids=True)
        #: When the first token was sampled (perf_counter).
        self.first_token_at: float | None = None

    @property
    def n_past(self) -> int:
        """Tokens its sequence holds (the prompt so far, then generated)."""
        return self.sequence.n_known

    def _context_used(self) -> int:
        return self.sequence.n_known

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.prompt)

    def prompt_chunk(self, room: int) -> tuple[list[int], bool]:
        """The next at most ``room`` prompt tokens, and whether they end the
        prompt (then the last one's logits are sampled)."""
        chunk = self.prompt[self.n_past:self.n_past + room]
        return chunk, self.n_past + len(chunk) == len(self.prompt)

    def take(self, token: int) -> FinishReason | None:
        """Account the token just sampled; a finish reason if the job ends
        (an end-of-generation token, a grammar with nothing left, a stop
        string, the budget, cancel).

        Raises:
            RequestRejected: the grammar's parse stacks passed their budget.
        """
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        meaning = self._meaning(token)
        if meaning.__class__ is not tuple:
            return meaning  # ended before this token counts
        text, logprob, _ = meaning
        output = self.output
        ended_by = output.push(text, logprob, token)
        if ended_by is not None:
            return ended_by
        n = output.n_pushed
        elapsed = now - self.first_token_at
        self.job.report_progress(len(self.prompt), n, self.max_tokens,
                                 n / elapsed if elapsed > 0 else 0.0,
                                 self.n_past)
        if n >= self.max_tokens:
            return FinishReason.LENGTH
        if self.job.should_stop():
            return FinishReason.CANCELLED
        self.pending = token
        return None

    def result(self, finish: FinishReason) -> GenerationResult:
        """As ``TokenLoop.result``: usage, timings (prompt time until the
        first token), and what was held back (nothing of a cancelled job)."""
        ended = time.perf_counter()
        first = self.first_token_at or ended
        output = self.output
        cancelled = finish == FinishReason.CANCELLED
        return GenerationResult(
            finish_reason=finish,
            prompt_tokens=len(self.prompt),
            completion_tokens=output.n_pushed,
            cached_tokens=self.cached_tokens,
            prompt_ms=(first - self.started) * 1000,
            predicted_ms=(ended - first) * 1000,
            tail_text="" if cancelled else output.tail(self.detok.flush()),
            tail_logprobs=[] if cancelled else output.tail_logprobs(),
            tail_token_ids=b"" if cancelled else output.tail_token_ids(),
            stopping_word=output.stopper.matched,
            truncated=self.context_limited and finish == FinishReason.LENGTH,
        )

    def close(self) -> None:
        """Free the sampler chain and the grammar (idempotent)."""
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
            self.logits.close()
