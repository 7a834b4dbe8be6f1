"""A model worker's settings: one frozen object from flags and ``LLAMAPOOL_*``.

A flag given to ``llamapool worker`` wins over its variable, which wins over
the default (``protocol.settings.load``). The engine's settings (model,
context, threads, chat format) are here too, so one object says everything a
worker process does. Every default is documented here:

| variable                       | default     | meaning                           |
|--------------------------------|-------------|-----------------------------------|
| LLAMAPOOL_BROKER               | (required)  | broker workers endpoint(s), comma |
| LLAMAPOOL_ENGINE               | llama.cpp   | llama.cpp or synthetic (no model) |
| LLAMAPOOL_MODEL                | (none)      | GGUF file (llama.cpp engine)      |
| LLAMAPOOL_CTX                  | 2048        | context tokens per slot           |
| LLAMAPOOL_SLOTS                | 1           | slots (sequences) in this worker  |
| LLAMAPOOL_THREADS              | 0           | llama.cpp threads: N, 0 or auto   |
| LLAMAPOOL_POOL_CORES           | (all CPUs)  | host cores for auto threads       |
| LLAMAPOOL_CHAT_FORMAT          | (template)  | named chat format, e.g. gemma     |
| LLAMAPOOL_CHAT_TEMPLATE        | (none)      | llama.cpp template name, or Jinja |
| LLAMAPOOL_CHAT_TEMPLATE_FILE   | (none)      | Jinja chat template file          |
| LLAMAPOOL_MODEL_NAME           | (file name) | name in /v1/models                |
| LLAMAPOOL_MODEL_ALIASES        | (none)      | other names, a comma list         |
| LLAMAPOOL_EMBEDDING_BATCH      | 512         | longest embedding input (tokens)  |
| LLAMAPOOL_TOKENS_PER_SECOND    | 50.0        | synthetic engine output rate      |
| LLAMAPOOL_HEARTBEAT_INTERVAL_S | 1.0         | heartbeat to the broker           |
| LLAMAPOOL_HEARTBEAT_LIVENESS   | 3           | missed beats = broker lost        |
| LLAMAPOOL_CREDIT_WINDOW_FRAMES | 256         | TOKEN frames before a pause       |
| LLAMAPOOL_STALL_TIMEOUT_S      | 60.0        | paused job cancelled after        |
| LLAMAPOOL_SHUTDOWN_GRACE_S     | 30.0        | after SIGTERM, the job may finish |
| LLAMAPOOL_CANCEL_TIMEOUT_S     | 30.0        | stuck cancel: process exits (8)   |
| LLAMAPOOL_WORKER_NAME          | (host:pid)  | name in logs and /slots           |
| LLAMAPOOL_CURVE_SERVER_KEY     | (none)      | the broker's public .key (CURVE)  |
| LLAMAPOOL_CURVE_SECRET_KEY     | (none)      | own .key_secret (CURVE)           |
| LLAMAPOOL_WORKER_METRICS_PORT  | 0           | port for own /metrics (0: off)    |
| LLAMAPOOL_CACHE_RAM            | 2048        | saved prompt states, MiB (0: off) |
| LLAMAPOOL_SLOT_SAVE_PATH       | (off)       | slot files' directory             |
| LLAMAPOOL_GPU_LAYERS           | 0           | layers on a GPU (-1: all)         |
| LLAMAPOOL_FLASH_ATTN           | on          | flash attention: on or off        |
| LLAMAPOOL_REPACK               | auto        | weight repacking: auto, on or off |
| LLAMAPOOL_N_PREDICT            | (endpoint)  | token budget, request without one |
| LLAMAPOOL_SEED                 | (random)    | seed, request without one         |
| LLAMAPOOL_TEMP                 | 0.8         | temperature, request without one  |
| LLAMAPOOL_TOP_K                | 40          | top_k, request without one        |
| LLAMAPOOL_TOP_P                | 0.95        | top_p, request without one        |
| LLAMAPOOL_MIN_P                | 0.05        | min_p, request without one        |
| LLAMAPOOL_REPEAT_PENALTY       | 1.0         | repeat_penalty, request without   |
| LLAMAPOOL_PRESENCE_PENALTY     | 0.0         | presence_penalty, request without |
| LLAMAPOOL_FREQUENCY_PENALTY    | 0.0         | frequency_penalty, req. without   |
| LLAMAPOOL_PHASE_FILE           | (none)      | phase file, read after a crash    |
| LLAMAPOOL_LAST_FAILURE         | (none)      | last run's death, from supervisor |
| LLAMAPOOL_HELD                 | off         | held crash loop: load nothing     |
"""

from __future__ import annotations

import dataclasses
import math
import os

from protocol import defaults, limits, timing
from protocol.broker_list import split_endpoints
from protocol.chat_choice import (
    chat_choice,
    chat_template_file_setting,
    chat_template_setting,
    checked_chat_choice,
)
from protocol.payloads import RequestDefaults
from protocol.settings import (
    ConfigError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    setting,
)
from workers.model.weight_repack import REPACK_CHOICES

#: Engines a worker can run (``--engine``); llama.cpp is the only real one.
ENGINES = ("llama.cpp", "synthetic")


def finite_float(text: str) -> float:
    """A penalty: any finite number (llama-server refuses the others)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"must be finite, not {text}")
    return value


def thread_count(text: str) -> str:
    """``--threads``: ``auto``, or a thread count (0: llama.cpp's choice)."""
    if text.strip() == "auto":
        return "auto"
    return str(non_negative_int(text))


#: Most slots one worker may hold (``--slots``).
MAX_SLOTS = 64

#: More layers than any model has: llama.cpp caps the count at the model's.
MAX_GPU_LAYERS = 100_000


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    broker_endpoint: str = setting(
        dataclasses.MISSING, "LLAMAPOOL_BROKER",
        "broker workers endpoint(s), comma",
        flag="--broker", repeat=True,
        help="broker workers endpoint; repeat (or a comma list) for several: "
             "the worker registers with one and moves on when it goes silent")
    engine: str = setting(
        "llama.cpp", "LLAMAPOOL_ENGINE",
        "llama.cpp or synthetic (no model)",
        flag="--engine", choices=ENGINES,
        help="llama.cpp, or synthetic: a stand-in with no model that emits "
             "'tok0 tok1 ...' at --tokens-per-second")
    model_path: str = setting(
        "", "LLAMAPOOL_MODEL", "GGUF file (llama.cpp engine)",
        flag="--model")
    n_ctx: int = setting(defaults.N_CTX, "LLAMAPOOL_CTX", "context tokens per slot",
        flag="--ctx", parse=positive_int)
    #: Slots in this process: one sequence each in one context, decoded as
    #: one batch (``workers.model.batched_worker``); 1 is the one-slot
    #: worker. Each slot registers with the broker as a slot of its own.
    n_slots: int = setting(
        1, "LLAMAPOOL_SLOTS", "slots (sequences) in this worker",
        flag="--slots", parse=positive_int,
        help="slots in this worker, decoded together as one batch (default "
             "1); each is a slot in the broker's ledger, with --ctx tokens")
    #: ``auto``: the broker gives each busy worker its share of
    #: ``pool_cores`` among the busy workers on its host
    #: (``workers.broker.thread_budget``).
    n_threads: str = setting(
        "0", "LLAMAPOOL_THREADS", "llama.cpp threads: N, 0 or auto",
        flag="--threads", parse=thread_count)
    pool_cores: int = setting(
        0, "LLAMAPOOL_POOL_CORES", "host cores for auto threads",
        shown="(all CPUs)",
        flag="--pool-cores", parse=positive_int)
    chat_format: str | None = setting(
        None, "LLAMAPOOL_CHAT_FORMAT", "named chat format, e.g. gemma",
        shown="(template)",
        flag="--chat-format",
        help="named chat format (e.g. gemma), or 'template' for the GGUF's "
             "Jinja template (default: template if present)")
    chat_template: str = chat_template_setting()
    chat_template_file: str = chat_template_file_setting()
    model_name: str = setting(
        "", "LLAMAPOOL_MODEL_NAME", "name in /v1/models", shown="(file name)",
        flag="--model-name")
    #: Other names a request's ``model`` may give this model by (issue 30):
    #: a comma list; ``--alias`` may be repeated, each a name or a list.
    aliases: str = setting(
        "", "LLAMAPOOL_MODEL_ALIASES", "other names, a comma list",
        shown="(none)", flag="--alias", repeat=True,
        help="another name requests may give the model by (repeatable, or a "
             "comma list)")
    #: The embedding context's size and batch (``workers.model.embedding``):
    #: the longest embedding input, in tokens.
    embedding_batch_tokens: int = setting(
        512, "LLAMAPOOL_EMBEDDING_BATCH", "longest embedding input (tokens)",
        flag="--embedding-batch", parse=positive_int)
    tokens_per_second: float = setting(
        50.0, "LLAMAPOOL_TOKENS_PER_SECOND", "synthetic engine output rate",
        flag="--tokens-per-second", parse=positive_float)
    heartbeat_interval_s: float = setting(
        timing.HEARTBEAT_INTERVAL_S, "LLAMAPOOL_HEARTBEAT_INTERVAL_S",
        "heartbeat to the broker",
        flag="--heartbeat-interval-s", parse=positive_float)
    heartbeat_liveness: int = setting(
        timing.HEARTBEAT_LIVENESS, "LLAMAPOOL_HEARTBEAT_LIVENESS",
        "missed beats = broker lost",
        flag="--heartbeat-liveness", parse=positive_int)
    credit_window_frames: int = setting(
        timing.CREDIT_WINDOW_FRAMES, "LLAMAPOOL_CREDIT_WINDOW_FRAMES",
        "TOKEN frames before a pause")
    stall_timeout_s: float = setting(
        timing.STALL_TIMEOUT_S, "LLAMAPOOL_STALL_TIMEOUT_S",
        "paused job cancelled after",
        flag="--stall-timeout-s", parse=positive_float)
    #: After SIGTERM, how long the running job may continue before it is ended.
    shutdown_grace_s: float = setting(
        30.0, "LLAMAPOOL_SHUTDOWN_GRACE_S", "after SIGTERM, the job may finish",
        flag="--shutdown-grace-s", parse=non_negative_float)
    #: A job cancelled this long ago and not ended holds the process in
    #: native code: it exits (``worker_phase.CANCEL_TIMEOUT_EXIT``) for its
    #: supervisor to start a fresh one (the broker keeps the same deadline).
    cancel_timeout_s: float = setting(
        timing.CANCEL_TIMEOUT_S, "LLAMAPOOL_CANCEL_TIMEOUT_S",
        "stuck cancel: process exits (8)",
        flag="--cancel-timeout-s", parse=positive_float)
    worker_name: str = setting(
        "", "LLAMAPOOL_WORKER_NAME", "name in logs and /slots", shown="(host:pid)",
        flag="--worker-name")
    #: CURVE key files for the link to the broker (``protocol.curve``).
    curve_server_key: str = setting(
        "", "LLAMAPOOL_CURVE_SERVER_KEY", "the broker's public .key (CURVE)",
        flag="--curve-server-key")
    curve_secret_key: str = setting(
        "", "LLAMAPOOL_CURVE_SECRET_KEY", "own .key_secret (CURVE)",
        flag="--curve-secret-key")
    metrics_port: int = setting(
        0, "LLAMAPOOL_WORKER_METRICS_PORT", "port for own /metrics (0: off)",
        flag="--metrics-port", parse=non_negative_int)

    #: The prompt-state cache (``workers.model.prompt_cache``). A Gemma 3
    #: 270M state costs 10-18 KiB per token (BENCHMARKS.md section 12): 2 GiB
    #: holds ~200 conversations of 1000 tokens, and two workers stay far
    #: inside a 24 GiB machine.
    cache_ram_mib: int = setting(
        2048, "LLAMAPOOL_CACHE_RAM", "saved prompt states, MiB (0: off)",
        flag="--cache-ram", parse=non_negative_int, metavar="MIB")
    #: llama-server's ``--slot-save-path``: where ``POST /slots/{id}?action=
    #: save|restore`` keep slot files (``workers.model.slot_files``), on the
    #: worker's host, since its KV cache is in this process. Created if
    #: missing; "" refuses save and restore as llama-server does (erase
    #: still works).
    slot_save_path: str = setting(
        "", "LLAMAPOOL_SLOT_SAVE_PATH", "slot files' directory",
        shown="(off)", flag="--slot-save-path", metavar="DIR")
    #: llama.cpp's ``n_gpu_layers``. Only a GPU build of llama-cpp-python
    #: offloads; ``make serve`` installs the CPU build (docs/operations.md, "GPUs").
    #: Which device: ``CUDA_VISIBLE_DEVICES`` (``llamapool up --gpus``).
    gpu_layers: int = setting(
        0, "LLAMAPOOL_GPU_LAYERS", "layers on a GPU (-1: all)",
        flag="--gpu-layers", parse=int, metavar="N")
    #: llama.cpp's flash attention, on by default as llama-server's
    #: ``-fa auto`` turns it on wherever the backend has it (every CPU and
    #: CUDA build). It decodes faster: 1.11x at concurrency 2 on one batched
    #: worker here (benchmarks section 23). Its cost: a prompt continued from
    #: a cached KV state (the prompt-state cache, the live sequence) no
    #: longer gives exactly the tokens a cold prefill gives under greedy
    #: sampling (the attention sums run in another order for a split batch);
    #: ``off`` keeps that exact (tests/test_prompt_cache_gemma.py pins it).
    flash_attn: str = setting(
        "on", "LLAMAPOOL_FLASH_ATTN", "flash attention: on or off",
        flag="--flash-attn", choices=("on", "off"))
    #: llama.cpp's weight repacking (llama-server's ``--no-repack``): auto
    #: turns it off on a CPU with AMX, whose kernel crashes at the vendored
    #: llama.cpp, and keeps it on elsewhere (``workers.model.weight_repack``).
    repack: str = setting(
        "auto", "LLAMAPOOL_REPACK", "weight repacking: auto, on or off",
        flag="--repack", choices=REPACK_CHOICES,
        help="llama.cpp's weight repacking (off: llama-server's --no-repack); "
             "auto turns it off on a CPU with AMX, whose kernel crashes at "
             "this llama.cpp")
    #: llama-server's request defaults, as its users put them in a unit
    #: file: used for a request that leaves the field out (an explicit
    #: value always wins), and shown by ``/props``. None: the pool's
    #: defaults (``protocol.payloads.Sampling``; the endpoint's budget).
    n_predict: int | None = setting(
        None, "LLAMAPOOL_N_PREDICT", "token budget, request without one",
        shown="(endpoint)", flag="--n-predict", parse=int, metavar="N",
        help="tokens to predict for a request that names no max_tokens or "
             "n_predict (-1: until the context is full; llama-server's -n)")
    seed: int | None = setting(
        None, "LLAMAPOOL_SEED", "seed, request without one",
        shown="(random)", flag="--seed", parse=non_negative_int,
        help="the RNG seed of a request that names none (default: a fresh "
             "random seed each request)")
    temperature: float | None = setting(
        None, "LLAMAPOOL_TEMP", "temperature, request without one",
        shown="0.8", flag="--temp", parse=non_negative_float)
    top_k: int | None = setting(
        None, "LLAMAPOOL_TOP_K", "top_k, request without one", shown="40",
        flag="--top-k", parse=non_negative_int)
    top_p: float | None = setting(
        None, "LLAMAPOOL_TOP_P", "top_p, request without one", shown="0.95",
        flag="--top-p", parse=non_negative_float)
    min_p: float | None = setting(
        None, "LLAMAPOOL_MIN_P", "min_p, request without one", shown="0.05",
        flag="--min-p", parse=non_negative_float)
    repeat_penalty: float | None = setting(
        None, "LLAMAPOOL_REPEAT_PENALTY", "repeat_penalty, request without",
        shown="1.0", flag="--repeat-penalty", parse=positive_float)
    presence_penalty: float | None = setting(
        None, "LLAMAPOOL_PRESENCE_PENALTY", "presence_penalty, request without",
        shown="0.0", flag="--presence-penalty", parse=finite_float)
    frequency_penalty: float | None = setting(
        None, "LLAMAPOOL_FREQUENCY_PENALTY", "frequency_penalty, req. without",
        shown="0.0", flag="--frequency-penalty", parse=finite_float)
    #: ``protocol.worker_phase``: one line, rewritten at each phase
    #: (loading, warm-up, idle, job <id>), read by ``llamapool up`` or the
    #: systemd unit's ``ExecStopPost`` after a native crash.
    phase_file: str = setting(
        "", "LLAMAPOOL_PHASE_FILE", "phase file, read after a crash",
        shown="(none)")
    #: Set by the supervisor on a restart after a crash; told to the broker
    #: while loading, so ``/health`` and ``/slots`` say why it restarts.
    last_failure: str = setting(
        "", "LLAMAPOOL_LAST_FAILURE", "last run's death, from supervisor",
        shown="(none)")
    #: Set by ``llamapool up`` for a worker it stopped restarting: the
    #: process registers as failed, with ``last_failure``, and loads nothing.
    held: bool = setting(
        False, "LLAMAPOOL_HELD", "held crash loop: load nothing", shown="off")

    def __post_init__(self) -> None:
        split_endpoints(self.broker_endpoint)  # ConfigError if empty or repeated
        # At most one of the chat template settings.
        checked_chat_choice(self.chat_format, self.chat_template,
                            self.chat_template_file)
        threads = str(self.n_threads).strip()
        if threads != "auto" and not (threads.isdigit()
                                      and int(threads) <= limits.MAX_THREADS):
            raise ConfigError(f"LLAMAPOOL_THREADS={self.n_threads!r}: a count "
                              f"from 0 to {limits.MAX_THREADS}, or auto")
        object.__setattr__(self, "n_threads", threads)
        if not 0 <= self.pool_cores <= limits.MAX_THREADS:
            raise ConfigError(f"LLAMAPOOL_POOL_CORES={self.pool_cores}: from 1 "
                              f"to {limits.MAX_THREADS} (0: the usable CPUs)")
        self._check_slots()
        if self.repack not in REPACK_CHOICES:
            raise ConfigError(f"LLAMAPOOL_REPACK={self.repack!r}: "
                              f"{', '.join(REPACK_CHOICES)}")
        if self.flash_attn not in ("on", "off"):
            raise ConfigError(f"LLAMAPOOL_FLASH_ATTN={self.flash_attn!r}: on or off")
        if self.cache_ram_mib < 0:
            raise ConfigError("LLAMAPOOL_CACHE_RAM must be 0 (off) or more MiB")
        if not -1 <= self.gpu_layers <= MAX_GPU_LAYERS:
            raise ConfigError(f"LLAMAPOOL_GPU_LAYERS={self.gpu_layers}: -1 (all) "
                              f"or 0 to {MAX_GPU_LAYERS}")
        # The broker drops a READY with longer names as malformed
        # (``protocol.limits``): refuse at startup instead of never
        # registering.
        for var, value in (("LLAMAPOOL_WORKER_NAME", self.worker_name),
                           ("LLAMAPOOL_MODEL_NAME", self.model_name)):
            if len(value) > limits.MAX_NAME_CHARS:
                raise ConfigError(f"{var} is {len(value)} characters; at most "
                                  f"{limits.MAX_NAME_CHARS}")
        self._check_aliases()
        self._check_request_defaults()
        # Cut, not refused: it is a supervisor's report, not a user's input.
        object.__setattr__(self, "last_failure",
                           self.last_failure[:limits.MAX_REASON_CHARS])

    @property
    def chat_choice(self) -> str | None:
        """The chat format, template name or file, as one string for the
        prompt builder (``protocol.chat_choice``)."""
        return chat_choice(self.chat_format, self.chat_template,
                           self.chat_template_file)

    @property
    def alias_list(self) -> list[str]:
        """``aliases`` as names, in order, each once, without the model's own."""
        names = [a.strip() for a in self.aliases.split(",") if a.strip()]
        return [a for i, a in enumerate(names)
                if a not in names[:i] and a != self.label]

    def _check_aliases(self) -> None:
        """The broker refuses a worker beyond these (``protocol.limits``):
        refused here, at startup, with words instead."""
        if len(self.alias_list) > limits.MAX_ALIASES:
            raise ConfigError(f"LLAMAPOOL_MODEL_ALIASES: {len(self.alias_list)} "
                              f"aliases; at most {limits.MAX_ALIASES}")
        for alias in self.alias_list:
            if len(alias) > limits.MAX_NAME_CHARS:
                raise ConfigError(f"alias {alias[:40]!r}... is {len(alias)} "
                                  f"characters; at most {limits.MAX_NAME_CHARS}")

    def _check_request_defaults(self) -> None:
        """The ranges the flags' parsers check, for values from variables
        (and llama-server's own: a repeat penalty above 0)."""
        checks = (
            ("LLAMAPOOL_N_PREDICT", self.n_predict, -1, None),
            ("LLAMAPOOL_SEED", self.seed, 0, 2**32 - 1),
            ("LLAMAPOOL_TEMP", self.temperature, 0, None),
            ("LLAMAPOOL_TOP_K", self.top_k, 0, None),
            ("LLAMAPOOL_TOP_P", self.top_p, 0, 1),
            ("LLAMAPOOL_MIN_P", self.min_p, 0, 1),
            ("LLAMAPOOL_PRESENCE_PENALTY", self.presence_penalty, None, None),
            ("LLAMAPOOL_FREQUENCY_PENALTY", self.frequency_penalty, None, None),
        )
        for var, value, lo, hi in checks:
            if value is None:
                continue
            if not math.isfinite(value) or (lo is not None and value < lo) or (
                    hi is not None and value > hi):
                where = f"from {lo}" if lo is not None else "finite"
                raise ConfigError(f"{var}={value}: {where}"
                                  + (f" to {hi}" if hi is not None else ""))
        if self.repeat_penalty is not None and not (
                math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise ConfigError(f"LLAMAPOOL_REPEAT_PENALTY={self.repeat_penalty}: "
                              "finite and above 0")

    @property
    def request_defaults(self) -> RequestDefaults:
        """What this worker fills in for a request's left-out fields."""
        return RequestDefaults(**{f.name: getattr(self, f.name)
                                  for f in dataclasses.fields(RequestDefaults)})

    def _check_slots(self) -> None:
        """What a worker of several slots cannot do yet, refused at start."""
        if not 1 <= self.n_slots <= MAX_SLOTS:
            raise ConfigError(f"LLAMAPOOL_SLOTS={self.n_slots}: from 1 to "
                              f"{MAX_SLOTS}")
        if self.n_slots == 1:
            return
        if self.engine != "llama.cpp":
            raise ConfigError(f"--slots {self.n_slots} needs the llama.cpp "
                              "engine")
        if self.n_threads == "auto":
            # The broker's budget is per registered slot: it would split one
            # context's threads among its own sequences.
            raise ConfigError(f"--slots {self.n_slots} with --threads auto is "
                              "not supported yet: give a thread count")

    @property
    def auto_threads(self) -> bool:
        return self.n_threads == "auto"

    @property
    def host_pool_cores(self) -> int:
        """Cores this host gives the pool: the setting, else the CPUs this
        process may run on."""
        return self.pool_cores or len(os.sched_getaffinity(0))

    @property
    def starting_threads(self) -> int | None:
        """Threads the engine loads with (None: llama.cpp's choice). Auto
        starts as a lone job would; the broker's THREADS adjusts it."""
        if self.auto_threads:
            return self.host_pool_cores
        return int(self.n_threads) or None

    @property
    def label(self) -> str:
        """The model's name before it has loaded (for LOADING heartbeats)."""
        if self.model_name:
            return self.model_name
        if self.engine == "synthetic":
            return "synthetic"
        return os.path.basename(self.model_path)
