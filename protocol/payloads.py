"""What the messages carry: the generation request, live progress, pool status.

These were plain dicts, and a dict is a promise nobody checks: the sampling
defaults were written once in the frontend's parser and again in the engine's
``.get("temperature", 0.8)`` calls (free to drift apart), and a heartbeat's
progress went into the broker's ledger unchecked, where a string in place of
a number crashed the broker's loop on the next STATUS or NO_SLOT. Each is now
a ``WireRecord`` (``protocol.records``), declared once as a frozen dataclass:
its defaults are the only defaults, and each field's annotation is also what
the socket edge accepts for it, as for the messages that carry it. A plain
``int`` or ``list[str]`` is checked as that type; a range, a length cap or a
closed set goes in ``Annotated`` (``Annotated[int, COUNT]``: a token count).

* ``GenerationRequest`` (with ``Sampling`` and ``ChatMessage``): built by the
  frontend from the OpenAI body (``frontend.openai_schema``), run by an engine
  (``workers.model``). The broker decodes it only to check it.
* ``JobProgress``: a busy worker's heartbeat; the broker's ledger turns it
  into the Retry-After hint and the KV-cache gauge.
* ``Usage`` and ``Timings``: what a FINAL frame says the job cost. They were
  dicts too, passed from a worker through the broker (which summed them into
  the pool's counters) to the client's JSON: a string, a list or a NaN in one
  became a 500 or a stream cut off after its headers. Counts are
  non-negative integers and times finite non-negative numbers
  (``protocol.records.Count``, ``NonNegative``).
* ``PoolStatus`` (with ``SlotStatus``, ``PoolTotals`` and
  ``HistogramSnapshot``): the broker's answer to STATUS, behind ``/health``,
  ``/slots``, ``/v1/models`` and ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

from protocol import limits
from protocol.prompt_cache import PromptCacheStatus
from protocol.records import (
    COUNT,
    FINITE,
    NON_NEGATIVE,
    OneOf,
    Text,
    WireRecord,
    wire_record,
)

#: Most alternatives per generated token that ``logprobs`` may ask for
#: (OpenAI's ``top_logprobs`` limit); the worker clamps to it too.
MAX_TOP_LOGPROBS = 20

#: What a generation request is: a raw prompt, or chat messages to render.
COMPLETION = "completion"
CHAT = "chat"
#: Embedding vectors of ``GenerationRequest.inputs`` (``frontend.embeddings``).
EMBEDDING = "embedding"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: What a model can do, as its workers announce it (``messages.Ready``).
CAPABILITIES = ("completion", "chat", "tools", "embeddings", "infill", "rerank")


# --- the generation request ---------------------------------------------------


@wire_record
class HistoryCall(WireRecord):
    """A tool call an earlier assistant turn made, as the client sent it
    back: the worker renders it in the model's own call format
    (``protocol.tool_formats``), or hands it to a template that renders
    ``tool_calls`` itself."""

    name: Annotated[str, Text(limits.MAX_NAME_CHARS)]
    #: The arguments, JSON text of an object (checked by the frontend).
    arguments: str
    id: Annotated[str, Text(limits.MAX_ID_CHARS)] = ""


@wire_record
class ChatMessage(WireRecord):
    """One chat turn; multi-part content was joined into text by the frontend."""

    role: Annotated[str, OneOf(*CHAT_ROLES)]
    content: str
    #: An assistant turn's reasoning, sent back by the client (""): the
    #: templates of reasoning models read it as ``reasoning_content``.
    reasoning_content: str = ""
    #: An assistant turn's tool calls (an older frontend wrote them into
    #: ``content`` as Hermes text instead).
    tool_calls: list[HistoryCall] = dataclasses.field(default_factory=list)
    #: A ``tool`` turn's answer names the call it answers ("": not given).
    tool_call_id: Annotated[str, Text(limits.MAX_ID_CHARS)] = ""

    def as_dict(self) -> dict:
        """The OpenAI-style dict chat templates render (a call's arguments
        as an object, which templates write with ``tojson``, as llama.cpp
        passes them to a template that takes objects)."""
        turn: dict = {"role": self.role, "content": self.content}
        if self.reasoning_content:
            turn["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            turn["tool_calls"] = [call_dict(c, i) for i, c in enumerate(self.tool_calls)]
        if self.tool_call_id:
            turn["tool_call_id"] = self.tool_call_id
        return turn


def call_dict(call: HistoryCall, index: int) -> dict:
    """One history call in OpenAI's shape, for a template."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        arguments = call.arguments  # checked by the frontend; a peer's text
    function = {"name": call.name, "arguments": arguments}
    return {"id": call.id or f"call_{index}", "type": "function",
            "function": function, **function}


@wire_record
class LogitBias(WireRecord):
    """One ``logit_bias`` entry: a token id, or a text whose every token is
    biased (llama.cpp's string keys; the worker tokenises it). ``never``
    bans the token(s) (llama.cpp's ``false``), whatever ``bias`` says."""

    token: int | None = None
    piece: str = ""
    bias: Annotated[float, FINITE] = 0.0
    never: bool = False


@wire_record
class Sampling(WireRecord):
    """How the next token is chosen. These defaults are the pool's defaults:
    llama.cpp's server's, which the frontend applies by leaving a field out."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: None: a fresh random seed for every request.
    seed: int | None = None
    #: Ban end-of-generation tokens (benchmarks want exactly max_tokens).
    ignore_eos: bool = False
    #: Added to the raw logits before any other sampler.
    logit_bias: list[LogitBias] = dataclasses.field(default_factory=list)


#: The samplers a model worker's own defaults fill when the client left
#: them out (``GenerationRequest.defaulted``, ``RequestDefaults``), as
#: llama-server takes them as flags; the token budget is ``max_tokens``.
DEFAULTED_SAMPLERS = ("seed", "temperature", "top_k", "top_p", "min_p",
                      "repeat_penalty", "presence_penalty", "frequency_penalty")


@wire_record
class RequestDefaults(WireRecord):
    """A model worker's defaults for what a request leaves out, as a
    llama-server user puts them in a unit file (``--n-predict``, ``--seed``,
    ``--temp``, ...). None: the worker has none, and the pool's default
    (``Sampling``'s, or the endpoint's token budget) stands. Sent in READY,
    so ``/props`` shows the defaults in force."""

    #: -1: no limit (until the context is full).
    n_predict: int | None = None
    seed: Annotated[int, COUNT] | None = None
    temperature: Annotated[float, NON_NEGATIVE] | None = None
    top_k: Annotated[int, COUNT] | None = None
    top_p: Annotated[float, NON_NEGATIVE] | None = None
    min_p: Annotated[float, NON_NEGATIVE] | None = None
    repeat_penalty: Annotated[float, NON_NEGATIVE] | None = None
    presence_penalty: Annotated[float, FINITE] | None = None
    frequency_penalty: Annotated[float, FINITE] | None = None

    def sampling(self, base: Sampling, left_out=DEFAULTED_SAMPLERS) -> Sampling:
        """``base`` with this worker's value for each sampler in ``left_out``
        that it has one for."""
        mine = {name: getattr(self, name) for name in DEFAULTED_SAMPLERS
                if name in left_out and getattr(self, name) is not None}
        return dataclasses.replace(base, **mine) if mine else base

    def budget(self, max_tokens: int | None) -> int | None:
        """The token budget of a request that gave none (``max_tokens``:
        the endpoint's own default; None: no limit)."""
        if self.n_predict is None:
            return max_tokens
        return None if self.n_predict < 0 else self.n_predict

    def fill(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with this worker's defaults for what its client left
        out (``request.defaulted``); an explicit value always wins."""
        left_out = set(request.defaulted)
        sampling = self.sampling(request.sampling, left_out)
        max_tokens = (self.budget(request.max_tokens) if "max_tokens" in left_out
                      else request.max_tokens)
        if sampling is request.sampling and max_tokens == request.max_tokens:
            return request
        return dataclasses.replace(request, sampling=sampling, max_tokens=max_tokens)


@wire_record
class EmbeddingInput(WireRecord):
    """One input of an embedding request: text for the worker to tokenise
    (with BOS and special tokens, as llama.cpp's server does), or token ids."""

    text: str = ""
    tokens: list[int] | None = None


@wire_record
class GenerationRequest(WireRecord):
    """One generation, as validated at the HTTP door (``frontend.openai_schema``).

    ``prompt`` is used when ``kind`` is completion, ``messages`` when chat.
    ``prompt_tokens`` and ``extra_stops`` are filled in by a frontend that can
    tokenise (``frontend.prompt_gate``): the prompt's token ids and the chat
    format's own stop strings, so the worker skips rendering. Token ids are
    checked against the vocabulary by the worker, which knows it.
    """

    kind: Annotated[str, OneOf(COMPLETION, CHAT, EMBEDDING)]
    prompt: str = ""
    messages: list[ChatMessage] = dataclasses.field(default_factory=list)
    #: None: until the context is full.
    max_tokens: int | None = None
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    stop: list[str] = dataclasses.field(default_factory=list)
    prompt_tokens: list[int] | None = None
    extra_stops: list[str] = dataclasses.field(default_factory=list)
    #: GBNF the output must match ("": free text). JSON schemas and
    #: ``response_format`` were turned into GBNF by the frontend.
    grammar: str = ""
    #: None: no log-probabilities. N: each generated token's log-probability
    #: and its N most likely alternatives (0 to ``MAX_TOP_LOGPROBS``).
    logprobs: int | None = None
    #: llama.cpp's ``timings_per_token``: every TOKEN frame carries the
    #: timings so far, which the frontend puts on every streamed chunk.
    timings_per_token: bool = False
    #: Chat only: the ``tools`` list (OpenAI's shape, as JSON text) for the
    #: chat template to render; "" offers none (``frontend.tool_calls``).
    tools: str = ""
    #: ``kind`` embedding: the inputs, one pooled vector each, in order.
    inputs: list[EmbeddingInput] = dataclasses.field(default_factory=list)
    #: ``kind`` embedding: llama.cpp's ``embd_normalize`` (-1 none, 0 max
    #: absolute, 1 taxicab, 2 Euclidean, >2 p-norm).
    embd_normalize: int = 2
    #: ``kind`` embedding: the vector size the client expects (OpenAI's
    #: ``dimensions``); None: the model's. Vectors are never truncated, so
    #: the worker refuses any other size before it computes anything.
    dimensions: int | None = None
    #: False (llama.cpp's native ``cache_prompt``): evaluate the whole prompt,
    #: reusing nothing the worker's KV cache holds.
    cache_prompt: bool = True
    #: Whose cached prompt states this job may reuse, and whose its own
    #: become: a keyed hash of the API key (``--cache-scope key``) and the
    #: request's ``cache_salt``, made by the frontend (``frontend.cache_scope``;
    #: the parsers leave the client's salt here, and the endpoint replaces it
    #: before SUBMIT). "" is the pool's shared scope. A worker reuses a saved
    #: state or its live sequence only for the tenant that made it, and the
    #: prefix fingerprints are in this scope (``protocol.prefix``).
    cache_tenant: Annotated[str, Text(limits.MAX_ID_CHARS)] = ""
    #: Chat only: llama.cpp's ``chat_template_kwargs``, a JSON object of
    #: variables for the chat template (``{"enable_thinking": false}``);
    #: "" for none. Checked by the frontend (``frontend.reasoning``).
    chat_template_kwargs: str = ""
    #: The model the job is for, as the frontend resolved the request's
    #: ``model`` (its name, never an alias; ``frontend.model_resolution``).
    #: The broker gives the job only a slot of it; "" (an older frontend):
    #: any slot, as before.
    model: Annotated[str, Text(limits.MAX_NAME_CHARS)] = ""
    #: Chat only: a call the output must be (``tool_choice`` required or
    #: named): "" none, "*" any offered tool, else the tool's name. The
    #: worker writes the grammar in the model's own call format
    #: (``protocol.tool_formats``), which only it knows for sure.
    force_call: Annotated[str, Text(limits.MAX_NAME_CHARS)] = ""
    #: Chat only: llama.cpp's ``add_generation_prompt`` (open the
    #: assistant's turn after the messages).
    add_generation_prompt: bool = True
    #: Chat only: llama.cpp's ``continue_final_message`` / assistant
    #: prefill: the last (assistant) message is left open and continued.
    continue_final: bool = False
    #: The fields the client left out, of ``max_tokens`` and
    #: ``DEFAULTED_SAMPLERS``: they hold the pool's default, which a worker
    #: with its own (``RequestDefaults``) replaces. A name this peer does
    #: not know is ignored.
    defaulted: list[Annotated[str, Text(limits.MAX_NAME_CHARS)]] = dataclasses.field(
        default_factory=list)
    #: ``kind`` embedding: not None makes it a rerank job (``frontend.
    #: rerank_api``): each input is a document (text only), scored against
    #: this query by the model's rank head, one score per input in order.
    #: A worker whose model has no rank head refuses it.
    rerank_query: str | None = None


# --- log-probabilities of generated tokens (TOKEN, FINAL) -------------------------


@wire_record
class TokenCandidate(WireRecord):
    """A token and its log-probability under the model's raw distribution;
    ``piece`` is its bytes (possibly part of a UTF-8 character)."""

    id: int
    piece: bytes
    logprob: Annotated[float, FINITE]


@wire_record
class TokenLogprob(WireRecord):
    """A generated token, its log-probability and the most likely alternatives
    (most likely first)."""

    id: int
    piece: bytes
    logprob: Annotated[float, FINITE]
    top: list[TokenCandidate] = dataclasses.field(default_factory=list)


# --- live progress ---------------------------------------------------------------


@wire_record
class JobProgress(WireRecord):
    """A busy worker's progress on ``job_id``, sent with every heartbeat.

    Zeros until the first token: the worker knows the job before the engine
    has counted its prompt.
    """

    job_id: str
    n_prompt: Annotated[int, COUNT] = 0
    n_generated: Annotated[int, COUNT] = 0
    #: The token budget after clamping to the context (not the request's).
    max_tokens: Annotated[int, COUNT] = 0
    tokens_per_s: Annotated[float, NON_NEGATIVE] = 0.0
    n_ctx_used: Annotated[int, COUNT] = 0
    #: None while generating. A number while the job is paused because its
    #: client is not reading (no credit): the worker cancels the job in that
    #: many seconds (its stall timeout) unless the client reads again. The
    #: broker's Retry-After counts it: a paused slot is not about to be free.
    pause_ends_in_s: Annotated[float, NON_NEGATIVE] | None = None
    #: llama.cpp threads the job decodes with now (0: not reported, e.g. the
    #: synthetic engine). Changes mid-job under ``--threads auto``.
    n_threads: Annotated[int, COUNT] = 0


# --- what a finished job cost (FINAL) -------------------------------------------


@wire_record
class Usage(WireRecord):
    """OpenAI's ``usage``: tokens in, out, and reused from the KV cache."""

    prompt_tokens: Annotated[int, COUNT]
    completion_tokens: Annotated[int, COUNT]
    total_tokens: Annotated[int, COUNT]
    #: Prompt tokens the worker's KV cache already held (not computed again).
    cached_tokens: Annotated[int, COUNT] = 0

    def public(self) -> dict:
        """The ``usage`` object of an OpenAI response."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@wire_record
class Timings(WireRecord):
    """llama.cpp's server's ``timings``: prompt evaluation and generation.

    ``prompt_n`` counts only the prompt tokens computed (not those reused
    from the cache, which are ``cache_n``); times are milliseconds, measured
    by the worker. A FINAL frame carries the job's; a TOKEN frame carries
    them so far when the request asked (``timings_per_token``).
    """

    prompt_n: Annotated[int, COUNT]
    prompt_ms: Annotated[float, NON_NEGATIVE]
    predicted_n: Annotated[int, COUNT]
    predicted_ms: Annotated[float, NON_NEGATIVE]
    #: Kept on the wire for older peers; ``public`` derives it from n and ms.
    predicted_per_second: Annotated[float, NON_NEGATIVE] = 0.0
    #: Prompt tokens the KV cache already held (llama.cpp's ``cache_n``).
    cache_n: Annotated[int, COUNT] = 0

    def public(self) -> dict:
        """The ``timings`` object of a response: llama.cpp's nine fields.

        The rates are derived here from the counts and times, as llama.cpp's
        ``server_slot_stats`` derives them, so they are always consistent
        (``per_second = n / ms * 1000``, ``per_token_ms = ms / n``; 0 when
        the divisor is 0). Generation divides by its decode steps, n - 1:
        the first token comes from the prompt's logits, and its time is
        prompt time (``n_gen_steps`` in llama-server).
        """
        steps = max(self.predicted_n - 1, 0)
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": _per_token_ms(self.prompt_ms, self.prompt_n),
            "prompt_per_second": _per_second(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": _per_token_ms(self.predicted_ms, steps),
            "predicted_per_second": _per_second(steps, self.predicted_ms),
        }


def _per_token_ms(ms: float, n: int) -> float:
    return ms / n if n > 0 else 0.0


def _per_second(n: int, ms: float) -> float:
    return 1e3 / ms * n if ms > 0 else 0.0


# --- pool status (the STATUS reply) -------------------------------------------------


@wire_record
class GpuPlacement(WireRecord):
    """Where a worker's model layers are (``/slots``).

    ``layers_requested``: ``--gpu-layers`` as llama.cpp was given it (-1: all).
    ``layers_offloaded``: how many are on a GPU: 0 for a CPU-only build of
    llama.cpp, whatever was requested. ``devices``: the worker's
    ``CUDA_VISIBLE_DEVICES`` ("" when unset: every device, or none).
    """

    layers_requested: int = 0
    layers_offloaded: Annotated[int, COUNT] = 0
    devices: Annotated[str, Text(limits.MAX_NAME_CHARS)] = ""


@wire_record
class SlotStatus(WireRecord):
    """One slot (one worker) in the ledger. Never any prompt text: the broker
    does not have it."""

    id: int
    #: loading, idle, busy, cancelling or failed (``workers.broker.ledger``).
    state: str
    id_task: str | None
    worker_name: str
    host: str
    pid: int
    model: str
    engine: str
    n_ctx: int
    lease_age_s: float | None
    #: Wall-clock (epoch) time the lease was taken, for humans.
    lease_taken_at: float | None
    jobs_served: int
    #: The job's last heartbeat; None while idle or before the first beat.
    progress: JobProgress | None = None
    #: The worker's prompt-state cache, from its last CACHE_REPORT (None
    #: before the first).
    prompt_cache: PromptCacheStatus | None = None
    #: Where its model's layers are (None: a worker of an older version).
    gpu: GpuPlacement | None = None
    #: How its last run died, while it loads again (state ``loading``) or
    #: is held after a crash loop (state ``failed``); "" otherwise.
    failure: str = ""
    #: Whether llama.cpp repacked its weights, and why (``--repack``).
    repack: str = ""
    #: Its worker's defaults for what a request leaves out (from READY;
    #: None: an older broker).
    defaults: RequestDefaults | None = None


@wire_record
class HistogramSnapshot(WireRecord):
    """A Prometheus-style cumulative histogram, plus its newest observations."""

    buckets: list[float]
    #: One count per bucket and a last one for +Inf.
    cumulative: list[int]
    sum: float
    count: int
    p50: float | None
    max: float | None
    #: The newest observations in arrival order (for per-run figures).
    recent: list[float]


@wire_record
class ModelTotals(WireRecord):
    """One model's share of ``PoolTotals``: the jobs its workers ran, and its
    refusals and waits (``workers.broker.pool_stats``), for the ``model``
    label of ``/metrics``. Its histograms carry no ``recent`` observations
    (the pool's do): a STATUS reply holds up to ``limits.MAX_MODELS`` of
    these."""

    name: str
    prompt_tokens_total: Annotated[int, COUNT] = 0
    prompt_tokens_cached_total: Annotated[int, COUNT] = 0
    tokens_generated_total: Annotated[int, COUNT] = 0
    request_success_total: Annotated[int, COUNT] = 0
    request_fail_total: Annotated[int, COUNT] = 0
    request_cancelled_total: Annotated[int, COUNT] = 0
    prompt_seconds_total: float = 0.0
    tokens_seconds_total: float = 0.0
    n_tokens_max: Annotated[int, COUNT] = 0
    n_decode_total: Annotated[int, COUNT] = 0
    cancel_release_s: HistogramSnapshot | None = None
    queue_wait_s: HistogramSnapshot | None = None
    #: SUBMITs refused for want of one of its slots (NO_SLOT), jobs that
    #: waited for one, and waits that ended without one, by why.
    no_slot: Annotated[int, COUNT] = 0
    queued: Annotated[int, COUNT] = 0
    queue_full: Annotated[int, COUNT] = 0
    queue_expired: Annotated[int, COUNT] = 0
    queue_left: Annotated[int, COUNT] = 0


@wire_record
class PoolTotals(WireRecord):
    """Totals over every job the broker saw end (``workers.broker.pool_stats``)."""

    prompt_tokens_total: int
    tokens_generated_total: int
    request_success_total: int
    request_fail_total: int
    request_cancelled_total: int
    prompt_seconds_total: float
    tokens_seconds_total: float
    #: From cancel (client gone) to the slot being free in the ledger.
    cancel_release_s: HistogramSnapshot
    #: Prompt tokens served from a KV cache or a restored prompt state
    #: (``prompt_tokens_details.cached_tokens`` summed over every job).
    prompt_tokens_cached_total: Annotated[int, COUNT] = 0
    #: The longest sequence (prompt + generation) any job reached.
    n_tokens_max: int = 0
    #: Model evaluations: one per job whose prompt was computed, plus one
    #: per generated token (``workers.broker.pool_stats``).
    n_decode_total: int = 0
    #: When these totals began (the broker's start, epoch seconds): what
    #: llama.cpp's ``Process-Start-Time-Unix`` header tells a scraper.
    started_at_unix: float = 0.0
    #: How long jobs waited for a slot (``--queue-max``); None from a broker
    #: that has no queue.
    queue_wait_s: HistogramSnapshot | None = None
    #: The same per model (its workers' jobs), each model once.
    models: list[ModelTotals] = dataclasses.field(default_factory=list)


@wire_record
class ModelStatus(WireRecord):
    """One model of a broker's ledger (``workers.broker.model_index``): its
    name, its aliases and capabilities (from its workers' READY), and its
    slots. ``n_ctx`` is the smallest context of its loaded workers (0: none
    loaded)."""

    name: str
    aliases: list[str] = dataclasses.field(default_factory=list)
    capabilities: list[str] = dataclasses.field(default_factory=list)
    n_ctx: Annotated[int, COUNT] = 0
    slots_total: Annotated[int, COUNT] = 0
    slots_idle: Annotated[int, COUNT] = 0
    slots_busy: Annotated[int, COUNT] = 0
    slots_loading: Annotated[int, COUNT] = 0
    #: Jobs waiting for one of its slots (``--queue-max``).
    jobs_waiting: Annotated[int, COUNT] = 0


@wire_record
class KeyUsage(WireRecord):
    """One named API key's jobs at a broker: tokens served, requests, and
    refusals by reason (``rate_limit`` reasons, ``no_slot``)."""

    name: str
    prompt_tokens: Annotated[int, COUNT] = 0
    completion_tokens: Annotated[int, COUNT] = 0
    requests: Annotated[int, COUNT] = 0
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    running: Annotated[int, COUNT] = 0
    waiting: Annotated[int, COUNT] = 0


@wire_record
class PoolStatus(WireRecord):
    """The broker's ledger and totals, as one STATUS reply carries them."""

    slots: list[SlotStatus]
    #: Registered and loaded (what "whole" is measured against).
    slots_total: int
    slots_loading: int
    slots_busy: int
    #: Idle and not draining: what a SUBMIT can get right now.
    slots_free: int
    #: Mean KV-cache fill (0-1) of the busy slots.
    kv_cache_usage_level: float
    jobs: int
    frontends: int
    #: The broker's event counters by name (``no_slot``, ``malformed_dropped``).
    counters: dict[str, int]
    stats: PoolTotals
    #: The hint a NO_SLOT would carry now.
    retry_after_s: float
    #: Jobs waiting for a slot (``--queue-max``): llama.cpp's
    #: ``requests_deferred``.
    jobs_waiting: Annotated[int, COUNT] = 0
    #: Each model of the ledger once (empty from an older broker: the
    #: frontend then knows the models by their slots' names alone).
    models: list[ModelStatus] = dataclasses.field(default_factory=list)
    #: Usage per named API key (a keys file's ``name``), since the broker
    #: started: ``workers.broker.key_limits``.
    keys: list[KeyUsage] = dataclasses.field(default_factory=list)

    @property
    def cancel_release_s(self) -> HistogramSnapshot:
        return self.stats.cancel_release_s

    def to_dict(self) -> dict:
        """The JSON shape of a snapshot, for tools and tests that print or
        compare one: idle slots show ``progress`` as ``{}``, and
        ``cancel_release_s`` is repeated at the top level."""
        out = dataclasses.asdict(self)
        for slot in out["slots"]:
            if slot["progress"] is None:
                slot["progress"] = {}
        out["cancel_release_s"] = out["stats"]["cancel_release_s"]
        return out


# --- trace context (SUBMIT) -----------------------------------------------------


@wire_record
class TraceContext(WireRecord):
    """The W3C trace context of the frontend's span for one job
    (``protocol.tracing``), so that the broker's and the worker's spans are
    its children. The strings are the ``traceparent`` and ``tracestate``
    headers as W3C writes them; a peer that cannot parse them makes no span
    for the job and runs it as usual. Never any prompt, output or key."""

    #: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``: 55 characters
    #: in version 00; a later version may append fields.
    traceparent: Annotated[str, Text(limits.MAX_TRACEPARENT_CHARS)]
    #: Vendor entries; W3C asks that at least 512 characters be passed on.
    tracestate: Annotated[str, Text(limits.MAX_TRACESTATE_CHARS)] = ""


# --- a named key's limits (SUBMIT) ------------------------------------------------


@wire_record
class KeyPolicy(WireRecord):
    """A named API key's limits (the frontend's keys file), carried in each
    of its jobs' SUBMIT so the broker, which sees every frontend's jobs,
    enforces them (``workers.broker.key_limits``). 0: no such limit. Never
    the key, nor its hash: only its name."""

    name: Annotated[str, Text(limits.MAX_KEY_NAME_CHARS)]
    #: Jobs running at once.
    max_slots: Annotated[int, COUNT] = 0
    #: Jobs waiting for a slot at once (the broker's ``--queue-max``).
    max_queued: Annotated[int, COUNT] = 0
    #: Prompt and completion tokens in any 60 s.
    tokens_per_minute: Annotated[int, COUNT] = 0
