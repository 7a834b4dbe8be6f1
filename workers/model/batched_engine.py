"""The batched llama.cpp engine: one context, K sequences, one decode per step.

A worker of ``--slots K`` holds one ``Llama`` whose context has K sequences
(``n_seq_max``) in one unified KV cache of K × ``--ctx`` cells, each
sequence held to ``--ctx`` tokens by its token budget (``BatchLlama`` says
why unified). Slot i's job is sequence i. Every step, the decode loop
(``workers.model.batch_runner``) hands ``decode`` the tokens of all the
slots that take part: one (the token sampled last) for each generating
slot, then prompt chunks for the slots still prefilling, at most
``n_batch`` tokens in all, as llama-server's ``update_slots`` builds its
batch. Each slot with an output position then samples from its own logits
with its own sampler chain.

Per slot, everything a one-slot engine does: grammar, logit bias and bans,
log-probabilities, tools and forced calls (``job_sampling``, shared with
the one-slot engine), embeddings, and prompt reuse. An embedding job holds
its slot like any job and runs in the worker's second, embedding context
(``workers.model.embedding``, as in a one-slot worker), on a thread of its
own beside the batch (``batch_runner``), so the other slots keep decoding. A slot's sequence keeps what
its last job left (``kv_sequence.SlotSequence``); a new job reuses its
longest prefix, or restores a saved state from the worker's one
prompt-state cache, by the one-slot engine's own rules (``prompt_reuse``,
``kv_cache``). Each slot reports its sequence and the cache's saved states
in its own CACHE_REPORT, so the broker's prefix routing picks the slot, not
just the worker. The cache's figures go out on slot 0 only, so that sums
over slots (``/metrics``) count the worker's one cache once.
"""

from __future__ import annotations

import logging
import os
import time

import llama_cpp

from protocol import defaults
from protocol.payloads import GenerationRequest
from protocol.prompt_cache import PromptCacheStatus
from workers.model import llama_internals
from workers.model.active_job import ActiveJob
from workers.model.batch_slots import SlotJob
from workers.model.embedding import DEFAULT_EMBEDDING_BATCH_TOKENS, Embedder
from workers.model.engine import token_budget
from workers.model.features import ALL_FEATURES, Feature
from workers.model.job_sampling import (
    job_detokenizer,
    request_logits,
    with_call_grammar,
)
from workers.model.kv_sequence import SlotSequence
from workers.model.llama_engine import (
    CTX_GRANULARITY,
    REPACK_DEFAULT,
    WARM_UP_TEXT,
    WARM_UP_TOKENS,
    gpu_placement,
    model_identity,
    prompt_tokens,
)
from workers.model.logits import RequestLogits
from workers.model.prompt_cache import MIB, PromptStateCache
from workers.model.prompt_reuse import PromptReuse
from workers.model.prompting import PromptBuilder
from workers.model.weight_repack import RepackChoice

log = logging.getLogger("llamapool.worker")


class DecodeFailed(RuntimeError):
    """``llama_decode`` refused a step; every slot in it ends with an error."""


class BatchedEngine:
    """K slots of one ``llama_cpp.Llama`` context, decoded together."""

    name = "batched llama.cpp"
    #: All a one-slot engine has.
    features: frozenset[Feature] = ALL_FEATURES

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
        cache_ram_mib: int = 0,
        embedding_batch_tokens: int = DEFAULT_EMBEDDING_BATCH_TOKENS,
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
        self.n_slots = n_slots
        self.n_batch = n_batch
        #: Tokens per slot (each sequence's share of the KV cache). The
        #: cache is unified, so llama.cpp's ``n_ctx_seq`` is all of it.
        self.n_ctx = per_slot
        self.gpu = gpu_placement(self.llama)
        self.repack = repack.shown
        self.model_name = model_name or os.path.basename(model_path)
        self._vocab = llama_internals.vocab_handle(self.llama)
        self.prompts = PromptBuilder(self.llama, chat_format)
        #: Embedding jobs' context, made on the first one.
        self.embedder = Embedder(self.llama, self.prompts, n_threads=n_threads,
                                 batch_tokens=embedding_batch_tokens)
        self._batch = llama_internals.new_batch(n_batch)
        self._eog_ids = [t for t in range(self.llama.n_vocab())
                         if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
        #: Saved prompt states, any slot's, restorable into any slot.
        self.cache = PromptStateCache(cache_ram_mib * MIB, model_identity(model_path))
        self.reuse = [PromptReuse(SlotSequence(self.llama, seq, self.n_ctx),
                                  self.cache) for seq in range(n_slots)]

    # --- a job joins ------------------------------------------------------------

    def start(self, seq: int, job: ActiveJob) -> SlotJob:
        """The job in slot ``seq``: its prompt tokenised, its sequence
        trimmed to the prefix it reuses (or a saved state restored), its
        sampler made.

        Raises:
            RequestRejected: see ``prompt_tokens``, ``token_budget``,
                ``with_call_grammar`` and ``request_logits``.
            TokenizeCancelled: cancelled while its prompt was tokenised.
        """
        started = time.perf_counter()
        request = job.request
        prompt, extra_stops = prompt_tokens(self.llama, self.prompts, self.n_ctx,
                                            request, job.should_stop)
        max_tokens = token_budget(len(prompt), self.n_ctx, request.max_tokens)
        request = with_call_grammar(self.prompts, request)
        logits = request_logits(request, self.prompts, vocab=self._vocab,
                                n_vocab=self.llama.n_vocab(), eog_ids=self._eog_ids)
        try:
            sampler = self._sampler(request, logits)
        except BaseException:
            logits.close()
            raise
        reuse = self.reuse[seq]
        plan = reuse.prepare(prompt, reuse=request.cache_prompt,
                             tenant=request.cache_tenant)
        return SlotJob(
            reuse.sequence, job, list(prompt), request.stop + extra_stops,
            max_tokens, sampler, logits,
            job_detokenizer(self._vocab, self.prompts, request), self._vocab,
            started, cached_tokens=plan.cached_tokens,
            timings_per_token=request.timings_per_token,
            context_limited=len(prompt) + max_tokens >= self.n_ctx)

    def _sampler(self, request: GenerationRequest, logits: RequestLogits):
        """The request's own sampler chain, as ``Llama.generate`` makes it
        (the same samplers in the same order, its seed, the request's logits
        processors first, then llama.cpp's logit-bias sampler for what
        ``RequestLogits`` leaves to it)."""
        sampling = request.sampling
        self.llama.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None
                            else sampling.seed)
        self.llama.logit_bias = logits.native_bias
        try:
            return llama_internals.sampler_chain(
                self.llama,
                top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                temp=sampling.temperature, repeat_penalty=sampling.repeat_penalty,
                frequency_penalty=sampling.frequency_penalty,
                presence_penalty=sampling.presence_penalty,
                logits_processor=logits.processor_list())
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
            seq, pos = slot.sequence.seq, slot.sequence.n_known
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
            slot.sequence.extend(tokens)
        return last_index

    def sample(self, slot: SlotJob, index: int) -> int:
        """Sample slot's next token from the logits at batch ``index`` (its
        chain accepts the token, for its penalties)."""
        return slot.sampler.sample_at(self._ctx, index)

    def forget(self, seq: int) -> None:
        """Empty sequence ``seq``: a failed decode left it unknown."""
        self.reuse[seq].clear_live()

    def report(self, seq: int) -> tuple[list[list[int]], PromptCacheStatus]:
        """Slot ``seq``'s CACHE_REPORT: its sequence, then the saved states;
        the cache's figures on slot 0 only."""
        status = self.cache.status() if seq == 0 else PromptCacheStatus()
        return self.reuse[seq].reported_blocks(), status

    def save_idle(self, seqs) -> bool:
        """Save the sequences of idle slots ``seqs`` (between steps, nothing
        to decode), as a one-slot engine does between jobs; True if the
        cache changed."""
        changed = False
        for seq in seqs:
            changed |= self.reuse[seq].save_live()
        return changed

    # --- the worker's lifecycle -------------------------------------------------

    def warm_up(self) -> None:
        """Prove the batched context computes before READY: the warm-up
        prompt in every sequence at once, then ``WARM_UP_TOKENS`` greedy
        steps of all of them; then every sequence is emptied."""
        prompt = self.llama.tokenize(WARM_UP_TEXT, add_bos=True, special=False)
        prompt = prompt[:max(1, self.n_batch // self.n_slots)]
        slots = [_WarmUpSlot(reuse.sequence) for reuse in self.reuse]
        sampler = llama_cpp.llama_sampler_init_greedy()
        try:
            entries = [(s, prompt, True) for s in slots]
            for _ in range(WARM_UP_TOKENS):
                indices = self.decode(entries)
                entries = [(s, [llama_cpp.llama_sampler_sample(sampler, self._ctx, i)],
                            True) for s, i in zip(slots, indices, strict=True)]
        finally:
            llama_cpp.llama_sampler_free(sampler)
            for reuse in self.reuse:
                reuse.clear_live()


class _WarmUpSlot:
    """A sequence in the warm-up, as ``decode`` reads it."""

    def __init__(self, sequence: SlotSequence) -> None:
        self.sequence = sequence
