"""The llama.cpp engine: one ``Llama``, its KV cache, and our own token loop.

We do not use ``create_completion(stream=True)``: on the tiny test model it
was about 40x slower per token than a bare ``Llama.generate`` loop. Tokens
come from ``generate()`` and run through the shared loop
(``workers.model.token_loop``: stop strings that never leak, credit,
progress, the budget, cancel between tokens); this engine supplies what is
its own: the sampled tokens, what each means (end of generation, the
grammar, incremental UTF-8-safe text, log-probabilities), and the thread
budget followed between tokens.
"""

from __future__ import annotations

import logging
import os
import time

import llama_cpp

from protocol import defaults
from protocol.errors import ErrorCode
from protocol.payloads import EMBEDDING, GenerationRequest, GpuPlacement
from workers.model import llama_internals
from workers.model.embedding import DEFAULT_EMBEDDING_BATCH_TOKENS, Embedder
from workers.model.engine import (
    GenerationResult,
    JobSink,
    RequestRejected,
    token_budget,
)
from workers.model.features import ALL_FEATURES
from workers.model.job_sampling import (
    job_detokenizer,
    request_logits,
    token_taker,
    with_call_grammar,
)
from workers.model.kv_sequence import LlamaSequence
from workers.model.llama_internals import EngineLlama
from workers.model.logits import RequestLogits
from workers.model.prompt_cache import MIB, PromptStateCache
from workers.model.prompt_reuse import PromptReuse
from workers.model.prompting import PromptBuilder, PromptError, ToolsUnsupported
from workers.model.token_loop import TokenLoop, cancelled_while_tokenizing
from workers.model.tokenizing import PromptTooLong, TokenizeCancelled
from workers.model.weight_repack import RepackChoice, repack_enabled

log = logging.getLogger("llamapool.worker")

#: llama.cpp pads the context size to a multiple of this.
CTX_GRANULARITY = 256

#: The worker's default (``--repack auto``), also for an engine built
#: without settings (tests, benchmarks): on an AMX CPU, llama.cpp's
#: default (repacked weights) crashes on Q4 weights (``weight_repack``).
REPACK_DEFAULT = repack_enabled("auto")

#: The warm-up's prompt (several tokens: a batch, not one decode) and how
#: many tokens it samples.
WARM_UP_TEXT = b"The quick brown fox jumps over the lazy dog."
WARM_UP_TOKENS = 4

def model_identity(model_path: str) -> str:
    """What a prompt state is tied to: the model file, by path, size and
    modification time (a state never loads into another model)."""
    st = os.stat(model_path)
    return f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}"



def gpu_placement(llama: llama_cpp.Llama) -> GpuPlacement:
    """Where a loaded model's layers are. llama.cpp offloads up to its layer
    count plus the output layer; a CPU-only build offloads nothing, whatever
    was asked (``llama_supports_gpu_offload``)."""
    requested = llama.model_params.n_gpu_layers
    if requested >= 0x7FFFFFFF:  # llama-cpp-python's spelling of -1 (all)
        requested = -1
    n_layer = llama_cpp.llama_model_n_layer(llama_internals.model_handle(llama)) + 1
    offloaded = 0
    if llama_cpp.llama_supports_gpu_offload():
        offloaded = n_layer if requested < 0 else min(requested, n_layer)
    return GpuPlacement(layers_requested=requested, layers_offloaded=offloaded,
                        devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def prompt_tokens(llama: llama_cpp.Llama, prompts: PromptBuilder, n_ctx: int,
                  request: GenerationRequest, should_stop,
                  ) -> tuple[list[int], list[str]]:
    """A request's prompt tokens and extra stop strings (see
    ``LlamaEngine._prompt_tokens``; the batched engine shares it).

    Raises:
        RequestRejected: invalid token ids, messages or tools, or a prompt
            that fills ``n_ctx``.
        TokenizeCancelled: ``should_stop`` turned true on the way.
    """
    given = request.prompt_tokens
    if given is not None:
        n_vocab = llama.n_vocab()
        # Never trust token ids from the network: llama.cpp aborts on some
        # out-of-range ids instead of returning an error. (That they are
        # ints was checked on decode; the range needs the vocabulary.)
        if not given or not all(0 <= t < n_vocab for t in given):
            raise RequestRejected(ErrorCode.INVALID_PROMPT_TOKENS,
                                  "prompt_tokens must be valid token ids")
        return given, request.extra_stops
    try:
        return prompts.tokens(request, n_ctx, should_stop)
    except ToolsUnsupported as exc:
        raise RequestRejected(ErrorCode.TOOLS_UNSUPPORTED, str(exc)) from None
    except PromptError as exc:
        raise RequestRejected(ErrorCode.INVALID_MESSAGES, str(exc)) from None
    except PromptTooLong as exc:
        raise RequestRejected.context_exceeded(
            exc.at_least, exc.n_ctx, exc.exact) from None


class LlamaEngine:
    """Serves one request at a time from one ``llama_cpp.Llama``."""

    name = "llama.cpp"
    features = ALL_FEATURES

    def __init__(
        self,
        model_path: str,
        *,
        n_ctx: int = defaults.N_CTX,
        n_threads: int | None = None,
        n_batch: int = 512,
        chat_format: str | None = None,
        model_name: str | None = None,
        embedding_batch_tokens: int = DEFAULT_EMBEDDING_BATCH_TOKENS,
        cache_ram_mib: int = 0,
        n_gpu_layers: int = 0,
        flash_attn: bool = False,
        repack: RepackChoice = REPACK_DEFAULT,
    ) -> None:
        # llama.cpp rounds the context up to a multiple of 256, but Llama sizes
        # its token record (input_ids) to the number passed in: past that
        # record the Python side drops tokens or raises after a successful
        # decode. Asking for the rounded size keeps the two equal.
        n_ctx = -(-n_ctx // CTX_GRANULARITY) * CTX_GRANULARITY
        self.llama = EngineLlama(
            model_path=model_path,
            use_extra_bufts=repack.enabled,
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=n_batch,
            n_gpu_layers=n_gpu_layers,
            flash_attn=flash_attn,
            verbose=False,
        )
        self.gpu = gpu_placement(self.llama)
        #: Shown in ``/slots``: whether weights were repacked, and why.
        self.repack = repack.shown
        self.n_ctx = min(self.llama.n_ctx(), len(self.llama.input_ids))
        #: Threads the context decodes with now (prompt and tokens alike).
        self.n_threads = self.llama.n_threads
        self.model_name = model_name or os.path.basename(model_path)
        self._vocab = llama_internals.vocab_handle(self.llama)
        self.prompts = PromptBuilder(self.llama, chat_format)
        #: Embedding jobs run in a second context, made on the first one.
        self.embedder = Embedder(self.llama, self.prompts, n_threads=n_threads,
                                 batch_tokens=embedding_batch_tokens)
        #: Saved prompt states (``--cache-ram``), and the one place that
        #: decides what a prompt starts from.
        self.reuse = PromptReuse(LlamaSequence(self.llama), PromptStateCache(
            cache_ram_mib * MIB, model_identity(model_path)))
        # Token ids that end generation (EOS, EOT, ...). ignore_eos bans them.
        self._eog_ids = [
            t
            for t in range(self.llama.n_vocab())
            if llama_cpp.llama_vocab_is_eog(self._vocab, t)
        ]

    # --- prompts ---------------------------------------------------------------

    def _prompt_tokens(
        self, request: GenerationRequest, sink: JobSink
    ) -> tuple[list[int], list[str]]:
        """Tokens from the frontend if it tokenised, else rendered here.

        Tokenising here stops between pieces when the job is cancelled
        (raises ``TokenizeCancelled``), so a client that gives up on a long
        prompt frees the slot without waiting for the whole prompt.
        """
        return prompt_tokens(self.llama, self.prompts, self.n_ctx, request,
                             sink.should_stop)

    # --- generation --------------------------------------------------------------

    def run(self, request: GenerationRequest, sink: JobSink) -> GenerationResult:
        if request.kind == EMBEDDING:
            return self.embedder.run(request, sink)
        started = time.perf_counter()
        try:
            prompt, extra_stops = self._prompt_tokens(request, sink)
        except TokenizeCancelled:
            return cancelled_while_tokenizing(started)
        max_tokens = token_budget(len(prompt), self.n_ctx, request.max_tokens)

        request = with_call_grammar(self.prompts, request)
        sampling = request.sampling
        self.llama.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None
                            else sampling.seed)
        logits = request_logits(request, self.prompts, vocab=self._vocab,
                                n_vocab=self.llama.n_vocab(), eog_ids=self._eog_ids)
        try:
            return self._generate(request, sink, prompt, extra_stops, max_tokens,
                                  logits, started)
        finally:
            logits.close()

    @property
    def tool_format(self) -> str:
        """The call format of this model's template (FINAL's ``tool_format``)."""
        fmt = self.prompts.tool_format
        return fmt.name if fmt is not None else ""

    def _generate(self, request: GenerationRequest, sink: JobSink,
                  prompt: list[int], extra_stops: list[str], max_tokens: int,
                  logits: RequestLogits, started: float) -> GenerationResult:
        # cache_prompt false (llama.cpp's native field): nothing reused; and
        # only the request's own tenant's prompts ever are (issue 29).
        plan = self.reuse.prepare(prompt, reuse=request.cache_prompt,
                                  tenant=request.cache_tenant)
        self._follow_thread_budget(sink)
        loop = TokenLoop(sink, started=started, n_prompt=len(prompt),
                         max_tokens=max_tokens, stops=request.stop + extra_stops,
                         cached_tokens=plan.cached_tokens,
                         timings_per_token=request.timings_per_token,
                         context_limited=len(prompt) + max_tokens >= self.n_ctx,
                         token_ids=True)
        detok = job_detokenizer(self._vocab, self.prompts, request)
        tokens = self._sampled_tokens(plan, request.sampling, logits)
        try:
            finish = loop.run(tokens, token_taker(self._vocab, logits, detok,
                                                   self._context_used),
                              between=self._follow_thread_budget)
        finally:
            # Closing the generator leaves the last sampled token un-evaluated;
            # kv_cache.plan_reuse accounts for that on the next request.
            tokens.close()
            self.llama.logit_bias = {}
        return loop.result(finish, detok.flush())

    def _context_used(self) -> int:
        """Tokens the context holds (sending a token decodes nothing: this is
        what it will be when the token's progress is reported)."""
        return self.llama.n_tokens

    def _sampled_tokens(self, plan, sampling, logits: RequestLogits):
        """llama-cpp-python's token generator for the plan's tokens, with the
        request's sampling (its end closes it)."""
        # Read when the generator makes its sampler chain, at the first token.
        self.llama.logit_bias = logits.native_bias
        return self.llama.generate(
            plan.tokens,
            reset=plan.reset,
            temp=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            repeat_penalty=sampling.repeat_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logits_processor=logits.processor_list(),
        )

    def warm_up(self) -> None:
        """Prove the model computes before the worker says READY, as
        llama-server does before it listens: a short prompt batch, then
        ``WARM_UP_TOKENS`` sampled tokens (each but the first one decode
        step), on this context with its threads, flash attention and
        weight layout. A broken kernel crashes or raises here, never in a
        client's job. The KV cache is emptied after, so the first job
        starts cold as if nothing had run."""
        prompt = self.llama.tokenize(WARM_UP_TEXT, add_bos=True, special=False)
        tokens = self.llama.generate(prompt, reset=True, temp=0.0)
        try:
            for _ in zip(range(WARM_UP_TOKENS), tokens):
                pass
        finally:
            tokens.close()
        self.reuse.clear_live()

    def _follow_thread_budget(self, sink: JobSink) -> None:
        """Between decodes: switch to the thread count the job should use
        (``--threads auto``). llama.cpp takes it on the next decode; no
        reload, and greedy output does not change."""
        wanted = sink.threads_to_use(self.n_threads)
        if wanted != self.n_threads:
            llama_cpp.llama_set_n_threads(
                llama_internals.context_handle(self.llama), wanted, wanted)
            # Keep Llama's own record true too.
            self.llama.n_threads = self.llama.n_threads_batch = wanted
            self.n_threads = wanted

    def idle(self) -> bool:
        """Work for the time between jobs (the worker calls it when no job
        waits): save the live sequence, which the next job that moves away
        from it would otherwise save inside its own time to first token.
        True if the prompt cache changed."""
        return self.reuse.save_live()

    @property
    def slot_reuse(self) -> PromptReuse:
        """The one KV sequence and its saved states, for llama-server's slot
        actions (``workers.model.slot_files``): a file is one such state."""
        return self.reuse

    def prompt_cache_report(self) -> tuple[list[list[int]], object]:
        """What CACHE_REPORT carries: fingerprint lists (live sequence
        first) and the cache's figures (``protocol.prompt_cache``)."""
        return self.reuse.reported_blocks(), self.reuse.cache.status()
