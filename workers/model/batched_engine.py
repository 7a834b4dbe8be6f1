"""The batched llama.cpp engine: one context, K sequences, one decode per step.

A worker of ``--slots K`` holds one ``Llama`` whose context has K sequences
(``n_seq_max``), each with ``--ctx`` tokens of its own in the KV cache
(llama.cpp's default, a non-unified cache: ``n_ctx_seq = n_ctx / K``).
Slot i's job is sequence i. Every step, the decode loop
(``workers.model.batch_runner``) hands ``decode`` the tokens of all the
slots that take part: one (the token sampled last) for each generating
slot, then prompt chunks for the slots still prefilling, at most
``n_batch`` tokens in all, as llama-server's ``update_slots`` builds its
batch. Each slot with an output position then samples from its own logits
with its own sampler chain.

What a one-slot worker does and this engine does not (yet), refused up
front by ``features`` (``workers.model.features``), never ignored: grammar,
logit bias, logprobs, tools and embeddings. It keeps no prompt states and
reuses no KV prefix: each job's sequence is emptied when it ends, and every
prompt is decoded from its first token (``cached_tokens`` 0, no
CACHE_REPORT, so the broker routes by idleness alone).
"""

from __future__ import annotations

import logging
import os
import time

import llama_cpp

from protocol import defaults
from protocol.payloads import GenerationRequest
from workers.model import llama_internals
from workers.model.active_job import ActiveJob
from workers.model.batch_slots import SlotJob
from workers.model.engine import token_budget
from workers.model.features import Feature
from workers.model.llama_engine import (
    CTX_GRANULARITY,
    REPACK_DEFAULT,
    WARM_UP_TEXT,
    WARM_UP_TOKENS,
    gpu_placement,
    prompt_tokens,
)
from workers.model.prompting import PromptBuilder
from workers.model.weight_repack import RepackChoice

log = logging.getLogger("llamapool.worker")


class DecodeFailed(RuntimeError):
    """``llama_decode`` refused a step; every slot in it ends with an error."""


class BatchedEngine:
    """K slots of one ``llama_cpp.Llama`` context, decoded together."""

    name = "batched llama.cpp"
    #: Nothing beyond text with stop strings, max_tokens, sampling and
    #: ignore_eos: a request for grammar, logit bias, logprobs, tools or
    #: embeddings is refused with ``unsupported_field``.
    features: frozenset[Feature] = frozenset()

    def __init__(
        self,
        model_path: str,
        *,
        n_slots: int,
        n_ctx: int = defaults.N_CTX,
        n_threads: int | None = None,
        n_batch: int = 512,
        chat_format: str | None = None,
        model_name: str | None = None,
        n_gpu_layers: int = 0,
        flash_attn: bool = False,
        repack: RepackChoice = REPACK_DEFAULT,
    ) -> None:
        per_slot = -(-n_ctx // CTX_GRANULARITY) * CTX_GRANULARITY
        self.llama = llama_internals.BatchLlama(
            model_path=model_path,
            n_seq_max=n_slots,
            use_extra_bufts=repack.enabled,
            n_ctx=per_slot * n_slots,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=n_batch,
            n_gpu_layers=n_gpu_layers,
            flash_attn=flash_attn,
            verbose=False,
        )
        self._ctx = llama_internals.context_handle(self.llama)
        self._mem = llama_internals.memory(self.llama)
        self.n_slots = n_slots
        self.n_batch = n_batch
        #: Tokens per slot (each sequence's share of the KV cache).
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self._ctx)
        self.gpu = gpu_placement(self.llama)
        self.repack = repack.shown
        self.model_name = model_name or os.path.basename(model_path)
        self._vocab = llama_internals.vocab_handle(self.llama)
        self.prompts = PromptBuilder(self.llama, chat_format)
        self._batch = llama_internals.new_batch(n_batch)
        self._eog_ids = [t for t in range(self.llama.n_vocab())
                         if llama_cpp.llama_vocab_is_eog(self._vocab, t)]

    # --- a job joins ------------------------------------------------------------

    def start(self, seq: int, job: ActiveJob) -> SlotJob:
        """The job in slot ``seq``, its prompt tokenised and its sampler made;
        its sequence is empty (the last job's was emptied when it ended).

        Raises:
            RequestRejected: see ``prompt_tokens`` and ``token_budget``.
            TokenizeCancelled: cancelled while its prompt was tokenised.
        """
        started = time.perf_counter()
        request = job.request
        prompt, extra_stops = prompt_tokens(self.llama, self.prompts, self.n_ctx,
                                            request, job.should_stop)
        max_tokens = token_budget(len(prompt), self.n_ctx, request.max_tokens)
        return SlotJob(
            seq, job, list(prompt), request.stop + extra_stops, max_tokens,
            self._sampler(request), self._vocab, started,
            timings_per_token=request.timings_per_token,
            context_limited=len(prompt) + max_tokens >= self.n_ctx)

    def _sampler(self, request: GenerationRequest):
        """The request's own sampler chain, as ``Llama.generate`` makes it
        (the same samplers in the same order, its seed, ignore_eos as
        llama.cpp's logit-bias sampler)."""
        sampling = request.sampling
        self.llama.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None
                            else sampling.seed)
        self.llama.logit_bias = (dict.fromkeys(self._eog_ids, float("-inf"))
                                 if sampling.ignore_eos else {})
        try:
            return llama_internals.sampler_chain(
                self.llama,
                top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                temp=sampling.temperature, repeat_penalty=sampling.repeat_penalty,
                frequency_penalty=sampling.frequency_penalty,
                presence_penalty=sampling.presence_penalty)
        finally:
            self.llama.logit_bias = {}

    # --- one step -------------------------------------------------------------------

    def decode(self, entries: list[tuple[SlotJob, list[int], bool]]) -> list[int]:
        """Decode one step: each entry's tokens at its sequence's next
        positions, logits wanted at its last token if its flag says so.
        Returns the batch index of each entry's last token.

        Raises:
            DecodeFailed: llama.cpp refused the batch (its slots' sequences
                are emptied by the caller).
        """
        batch = self._batch.batch
        n = 0
        last_index = []
        for slot, tokens, wants_logits in entries:
            seq, pos = slot.seq, slot.n_past
            for i, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = False
                n += 1
            batch.logits[n - 1] = wants_logits
            last_index.append(n - 1)
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise DecodeFailed(f"llama_decode returned {rc} for {n} tokens")
        for slot, tokens, _ in entries:
            slot.n_past += len(tokens)
        return last_index

    def sample(self, slot: SlotJob, index: int) -> int:
        """Sample slot's next token from the logits at batch ``index`` (its
        chain accepts the token, for its penalties)."""
        return llama_cpp.llama_sampler_sample(slot.sampler.sampler, self._ctx, index)

    def release(self, seq: int) -> None:
        """Empty sequence ``seq`` (its job ended)."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)

    # --- the worker's lifecycle -------------------------------------------------

    def warm_up(self) -> None:
        """Prove the batched context computes before READY: the warm-up
        prompt in every sequence at once, then ``WARM_UP_TOKENS`` greedy
        steps of all of them; then every sequence is emptied."""
        prompt = self.llama.tokenize(WARM_UP_TEXT, add_bos=True, special=False)
        prompt = prompt[:max(1, self.n_batch // self.n_slots)]
        slots = [_WarmUpSlot(seq) for seq in range(self.n_slots)]
        sampler = llama_cpp.llama_sampler_init_greedy()
        try:
            entries = [(s, prompt, True) for s in slots]
            for _ in range(WARM_UP_TOKENS):
                indices = self.decode(entries)
                entries = [(s, [llama_cpp.llama_sampler_sample(sampler, self._ctx, i)],
                            True) for s, i in zip(slots, indices, strict=True)]
        finally:
            llama_cpp.llama_sampler_free(sampler)
            llama_cpp.llama_memory_clear(self._mem, True)

    def idle(self) -> bool:
        """Nothing to do between jobs: no prompt states are kept."""
        return False

    def prompt_cache_report(self) -> None:
        """No prompt cache: no CACHE_REPORT."""
        return None


class _WarmUpSlot:
    """A sequence in the warm-up: where it is, as ``decode`` reads it."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.n_past = 0
