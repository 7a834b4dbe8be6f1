"""The llamapool wire protocol: one class per command, msgpack bodies.

Every multipart message is::

    [PROTOCOL_HEADER, command byte, msgpack body]

(a ROUTER socket adds the peer identity in front). The body is a msgpack array
of the message's fields in declaration order; a field that is itself a typed
payload (``protocol.payloads``: the generation request, heartbeat progress,
the status snapshot) is a nested array, checked the same way
(``protocol.records``). New optional fields go at the end with defaults, so an
older peer's shorter array still decodes.

A job's frames are zero or more TOKEN followed by exactly one terminal frame,
FINAL or ERROR (zguide MDP's PARTIAL... FINAL).

Peers and what they send:

* frontend -> broker: HELLO, SUBMIT, CANCEL, CREDIT, STATUS, HEARTBEAT
* broker -> frontend: ACCEPTED, NO_SLOT, TOKEN, FINAL, ERROR, STATUS_REPLY,
  HEARTBEAT, DISCONNECT
* worker -> broker: LOADING, READY, TOKEN, FINAL, ERROR, HEARTBEAT, DISCONNECT,
  CACHE_REPORT, THREADS_SET
* broker -> worker: SUBMIT, CANCEL, CREDIT, THREADS, HEARTBEAT, DISCONNECT

``decode`` validates every field's type at the socket edge and raises
``MalformedMessage``; callers log, count and drop. Nothing is ever unpickled.
Each command has size limits (``protocol.limits``), enforced before and
while its body is unpacked, so a hostile body costs little to refuse.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Annotated, ClassVar

import msgpack

from protocol import limits
from protocol.payloads import (
    GenerationRequest,
    GpuPlacement,
    JobProgress,
    KeyPolicy,
    PoolStatus,
    RequestDefaults,
    Timings,
    TokenLogprob,
    TraceContext,
    Usage,
)
from protocol.prompt_cache import PromptCacheStatus
from protocol.records import (
    COUNT,
    NON_NEGATIVE,
    TOKEN_IDS,
    Count,
    MalformedMessage,
    OneOf,
    Text,
    WireRecord,
    wire_record,
)

#: Protocol name and version. Bump the digits on any breaking change
#: (03: FINAL's usage and timings are typed arrays, no longer maps; 04: a
#: request's grammar, logit_bias and logprobs, which a worker of 03 would
#: drop as unknown trailing fields and so silently ignore; 05: a request's
#: timings_per_token, tools, embedding inputs and cache_prompt, SUBMIT's
#: id_slot, TOKEN's timings and embedding, FINAL's stopping_word, ERROR's
#: prompt and context sizes, THREADS and THREADS_SET: a peer of 04 would drop
#: these trailing fields, e.g. lease any slot for an ``id_slot`` or reuse the
#: cache for ``cache_prompt: false``; 06: a request's cache_tenant, which a
#: worker of 05 would drop and then reuse one tenant's cached prompt for
#: another's, the cross-key oracle of issue 29; 07: a request's model (a
#: broker of 06 would give the job any model's slot, the wrong-model answers
#: of issue 30), force_call and its history's tool_calls (a worker of 06
#: would not force the call, or drop earlier calls), and SUBMIT's key_policy
#: (a broker of 06 would enforce no key's limits), all without an error);
#: 09: THREADS' and THREADS_SET's seq (a broker of 08 would take a late
#: THREADS_SET as the answer to a newer THREADS).
PROTOCOL_HEADER = b"LLAMAPOOL09"

#: Largest body any command accepts (a STATUS reply); each command has its
#: own, smaller or equal, ceiling (``Message.LIMITS``).
MAX_BODY_BYTES = limits.MAX_FRAME_FROM_BROKER


# Kinds for ``Annotated`` fields (``protocol.records``): the strings the broker
# keeps, each with its cap (``protocol.limits``), and thread counts.
_HOST = Text(limits.MAX_HOST_CHARS)
_NAME = Text(limits.MAX_NAME_CHARS)
_ID = Text(limits.MAX_ID_CHARS)
_REASON = Text(limits.MAX_REASON_CHARS)
#: What may be shown of an API key (``frontend.auth.key_suffix``).
_KEY = Text(limits.MAX_KEY_LABEL_CHARS)
_THREADS = Count(1, limits.MAX_THREADS)
_CAPABILITY = Text(32)
_POOL_CORES = Count(0, limits.MAX_THREADS)


@dataclasses.dataclass(frozen=True)
class Message(WireRecord):
    """Base class. Subclasses set ``COMMAND`` and declare typed fields."""

    COMMAND: ClassVar[bytes]
    #: What a body of this command may contain (``protocol.limits``).
    LIMITS: ClassVar[limits.BodyLimits]
    _UNPACK_KW: ClassVar[dict]

    def to_wire(self) -> list[bytes]:
        """Encode as the frames that follow any routing identity."""
        return [PROTOCOL_HEADER, self.COMMAND, msgpack.packb(self.to_body())]


_BY_COMMAND: dict[bytes, type[Message]] = {}


def _register(command: int, body_limits: limits.BodyLimits = limits.SMALL):
    """Class decorator: make a ``wire_record`` of the class (its annotations
    are its field kinds) and bind a command byte and its size limits."""

    def wrap(cls: type[Message]) -> type[Message]:
        if bytes([command]) in _BY_COMMAND:  # two messages, one byte: a bug
            raise TypeError(f"command 0x{command:02x} is already "
                            f"{_BY_COMMAND[bytes([command])].__name__}")
        cls = wire_record(cls)
        cls.COMMAND = bytes([command])
        cls.LIMITS = body_limits
        cls._UNPACK_KW = {"raw": False, "strict_map_key": True,
                          **body_limits.unpack_kwargs()}
        _BY_COMMAND[cls.COMMAND] = cls
        return cls

    return wrap


# --- registration and liveness ---------------------------------------------


@_register(0x01)
class Ready(Message):
    """Worker -> broker: the model is loaded and this worker is idle.

    ``pool_cores`` > 0: the worker runs ``--threads auto`` and its host gives
    the pool that many cores; the broker then sends it THREADS. 0: a fixed
    thread count, never told anything.
    """

    worker_name: Annotated[str, _NAME]
    model: Annotated[str, _NAME]
    n_ctx: int
    pid: int
    host: Annotated[str, _HOST]
    engine: Annotated[str, _NAME] = "llama.cpp"
    pool_cores: Annotated[int, _POOL_CORES] = 0
    #: Where the model's layers are (``--gpu-layers``, ``CUDA_VISIBLE_DEVICES``).
    gpu: GpuPlacement = dataclasses.field(default_factory=GpuPlacement)
    #: Whether llama.cpp repacked the weights, and why (``--repack``).
    repack: Annotated[str, _REASON] = ""
    #: Other names a request may give ``model`` by (``--alias``; at most
    #: ``limits.MAX_ALIASES``), and what it can do (``payloads.CAPABILITIES``;
    #: a name this peer does not know is kept and shown, never routed on).
    #: An older broker ignores both: it serves the model by ``model`` alone.
    aliases: list[Annotated[str, _NAME]] = dataclasses.field(default_factory=list)
    capabilities: list[Annotated[str, _CAPABILITY]] = dataclasses.field(
        default_factory=list)
    #: Its defaults for what a request leaves out (``--n-predict``,
    #: ``--temp``, ...), for ``/props``; the worker applies them itself.
    defaults: RequestDefaults = dataclasses.field(default_factory=RequestDefaults)


@_register(0x05)
class Loading(Message):
    """Worker -> broker: I exist and am loading ``model``; no jobs yet.

    ``failure``: how this worker's last run ended, when it died (``killed by
    SIGSEGV during warm-up``); ``held``: its supervisor stopped restarting
    it after a crash loop, and this process only says so (it loads nothing).
    """

    worker_name: Annotated[str, _NAME]
    model: Annotated[str, _NAME]
    pid: int
    host: Annotated[str, _HOST]
    failure: Annotated[str, _REASON] = ""
    held: bool = False
    #: As READY's: a request naming one while it loads is told "Loading model".
    aliases: list[Annotated[str, _NAME]] = dataclasses.field(default_factory=list)


@_register(0x02)
class Hello(Message):
    """Frontend -> broker: register this frontend process."""

    pid: int
    host: Annotated[str, _HOST]


@_register(0x03)
class Heartbeat(Message):
    """Any direction. A busy worker attaches its job's live progress; an idle
    worker, the broker and frontends send none."""

    progress: JobProgress | None = None


@_register(0x06)
class Threads(Message):
    """Broker -> ``--threads auto`` worker: use ``n_threads`` llama.cpp threads
    from the next decode on (its share of its host's pool cores among the
    busy workers there; ``workers.broker.thread_budget``). ``seq`` counts
    the THREADS this broker sent the worker; THREADS_SET echoes it."""

    n_threads: Annotated[int, _THREADS]
    seq: Annotated[int, COUNT]


@_register(0x07)
class ThreadsSet(Message):
    """``--threads auto`` worker -> broker: from its next decode on it uses
    no more than ``n_threads`` threads (the answer to THREADS, sent once in
    force: at once if it already decodes with no more). The
    broker holds a new job's SUBMIT until the running workers on its host
    have stepped down (``workers.broker.step_down``). ``seq``: the THREADS
    this answers, so that a late answer to an older one releases nothing."""

    n_threads: Annotated[int, _THREADS]
    seq: Annotated[int, COUNT]


@_register(0x04)
class Disconnect(Message):
    """Broker -> peer: I do not know you (any more); register again."""

    reason: Annotated[str, _REASON]


@_register(0x08, limits.CACHE_REPORT)
class CacheReport(Message):
    """Worker -> broker: the prompt states it can serve without prefill.

    ``states``: one list of prefix fingerprints (``protocol.prefix``) per
    state, the live KV sequence first, at most ``limits.MAX_REPORTED_STATES``
    lists of at most ``prefix.MAX_BLOCKS`` each (``protocol.prompt_cache``).
    Replaces whatever the worker reported before.
    """

    states: list[list[int]]
    status: PromptCacheStatus = dataclasses.field(
        default_factory=PromptCacheStatus)


# --- jobs --------------------------------------------------------------------


@_register(0x10, limits.SUBMIT)
class Submit(Message):
    """Frontend -> broker -> worker: run one generation.

    ``request`` was validated at the HTTP door (``frontend.openai_schema``);
    the broker checks its types on decode like any field, and looks no
    further inside it.
    ``prefix_blocks`` are running hashes of the prompt's tokens, one per
    block (``protocol.prefix``); the broker routes to the idle worker whose
    KV cache already holds the longest run of them.
    ``id_slot`` (llama.cpp's native field): -1 lets the broker choose; any
    other value is the one slot (as ``/slots`` numbers them) the job must get.
    ``request_id`` (the HTTP request's ``X-Request-Id``) and ``key`` (what
    may be shown of its API key: the last 4 characters, as the frontend's
    request log has them, "-" for none) are for the broker's log lines about
    the job (a worker that died during it); they change no output, so a peer
    that drops them loses only those words.
    ``trace`` (None: the job is not traced) is the frontend's span for the
    job (``protocol.tracing``): the broker's and the worker's spans are its
    children. It changes no output either, so a peer that drops it only
    makes no spans; no version bump.
    ``client`` names the API key for the broker's fair wait (a keyed hash,
    never the key: ``frontend.cache_scope.client_id``; "" for none), and
    ``max_wait_s`` is the request's own cap on that wait (its
    ``X-Max-Wait-S``; 0: the broker's ``--queue-timeout-s``). A peer that
    drops them treats every request as one client's, with the broker's
    deadline.
    """

    job_id: Annotated[str, _ID]
    request: GenerationRequest
    prefix_blocks: list[int] = dataclasses.field(default_factory=list)
    id_slot: int = -1
    request_id: Annotated[str, _ID] = ""
    key: Annotated[str, _KEY] = ""
    trace: TraceContext | None = None
    client: Annotated[str, _ID] = ""
    max_wait_s: Annotated[float, NON_NEGATIVE] = 0.0
    #: A named key's limits (the frontend's keys file), enforced here at the
    #: broker; None: an unnamed key, or none. A peer that drops it enforces
    #: no per-key limit.
    key_policy: KeyPolicy | None = None


@_register(0x11)
class Accepted(Message):
    """Broker -> frontend: the job holds slot ``slot_id`` of a ``model`` worker.

    ``defaults``: that worker's defaults for what a request leaves out (its
    READY's), which it fills in: an answer that shows the settings it ran
    with (``/completion``'s ``generation_settings``) shows them."""

    job_id: str
    slot_id: int
    model: str = ""
    defaults: RequestDefaults | None = None


@_register(0x12)
class NoSlot(Message):
    """Broker -> frontend: every slot is busy; try again after the hint."""

    job_id: str
    retry_after_s: float


@_register(0x19)
class RateLimited(Message):
    """Broker -> frontend: the job's key is over one of its limits
    (``Submit.key_policy``): ``reason`` names it, ``limit`` and
    ``remaining`` are in its unit (jobs, or tokens per minute), and the key
    is under it again in ``reset_s``. The frontend answers 429 with
    Retry-After and ``x-ratelimit-*``; nothing was run or queued."""

    job_id: str
    reason: Annotated[str, OneOf("slots", "queued", "tokens")]
    limit: Annotated[int, COUNT]
    remaining: Annotated[int, COUNT]
    reset_s: Annotated[float, NON_NEGATIVE]


@_register(0x18)
class Queued(Message):
    """Broker -> frontend: no slot is free, and the job waits for one (the
    broker's ``--queue-max``): ``position`` jobs are ahead of it (0: next),
    and it waits at most ``wait_s`` more, then gets NO_SLOT. ACCEPTED or
    NO_SLOT follows; a CANCEL takes it out of the queue. Sent again when the
    job's place moves up (at most once a second), so a streamed waiter's
    client sees its progress. A frontend that does not know it waits only
    its own submit timeout."""

    job_id: str
    position: Annotated[int, COUNT]
    wait_s: Annotated[float, NON_NEGATIVE]


@_register(0x13)
class Cancel(Message):
    """Frontend -> broker -> worker: stop this job at the next token.

    ``broken`` (frontend -> broker only): why the frontend found the job's
    frames malformed ("" for a plain cancel). The broker relays TOKEN bodies
    without decoding them (``is_token_of``), so the frontend is the one that
    finds a broken TOKEN; the broker then treats the worker as it treats one
    that sent it a broken frame (counted, the worker disconnected). An older
    broker ignores the field and just cancels.
    """

    job_id: str
    broken: Annotated[str, _REASON] = ""


@_register(0x14)
class Credit(Message):
    """Frontend -> broker -> worker: the client consumed ``frames`` frames."""

    job_id: str
    frames: int


@_register(0x15, limits.JOB_FRAME)
class Token(Message):
    """Worker -> broker -> frontend: new output text covering ``n_tokens``.

    ``logprobs``: one entry per token this frame covers, when the request
    asked for them (``GenerationRequest.logprobs``). ``timings``: the job's
    timings so far, when it asked for them on every token
    (``GenerationRequest.timings_per_token``).

    ``embedding``: for an embedding job, one input's pooled vector as
    little-endian float32 (OpenAI's base64 form, before base64), one frame per
    input in order, so a batch flows under credit like generated text; its
    ``n_tokens`` counts that input's tokens."""

    job_id: str
    text: str
    n_tokens: int = 1
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    timings: Timings | None = None
    embedding: bytes = b""
    #: The ids of the ``n_tokens`` tokens this frame covers, in order
    #: (``pack_token_ids``), for llama.cpp's native ``tokens`` on every
    #: streamed chunk. Empty from an older worker, or an engine without a
    #: vocabulary (the synthetic one).
    token_ids: Annotated[bytes, TOKEN_IDS] = b""


def pack_token_ids(ids: list[int]) -> bytes:
    """Token ids as ``Token.token_ids`` carries them: little-endian uint32."""
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_token_ids(packed: bytes) -> list[int]:
    """The ids ``pack_token_ids`` packed (the length was checked on decode)."""
    return list(struct.unpack(f"<{len(packed) // 4}I", packed))


class FinishReason(str, enum.Enum):
    """How a job can end well; anything else in a FINAL is malformed."""

    #: An end-of-generation token, a stop string, or a grammar's end.
    STOP = "stop"
    #: ``max_tokens``, or the context, ran out.
    LENGTH = "length"
    #: Its client went away or its frontend asked (an acknowledged cancel).
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


FINISH_REASONS = tuple(reason.value for reason in FinishReason)


@_register(0x16, limits.JOB_FRAME)
class Final(Message):
    """Terminal frame: the job ended with ``finish_reason``.

    ``usage`` and ``timings`` are typed and range-checked on decode like every
    field: the frontend puts them into the client's JSON and the broker sums
    them into the pool's counters. ``text`` is output that was held back (a
    possible stop-string prefix) and is released at the end; ``logprobs``
    are the entries of its tokens. ``stopping_word`` is the stop string that
    ended the job ("" if none did), for llama.cpp's native ``stop_type``.
    ``truncated``: it stopped because the context was full, not at the
    request's own limit (llama.cpp's native ``truncated``; an older worker
    never sends it, and it reads false).
    """

    job_id: str
    finish_reason: Annotated[str, OneOf(*FINISH_REASONS)]
    usage: Usage
    timings: Timings
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    stopping_word: str = ""
    truncated: bool = False
    #: The ids of the tokens counted after the last TOKEN frame (those of
    #: ``text``, and of a stop string's tokens), as ``Token.token_ids``.
    token_ids: Annotated[bytes, TOKEN_IDS] = b""
    #: With tools offered: the call format the model's template teaches
    #: (``protocol.tool_formats``), for the frontend to read the answer's
    #: calls in; "" (an older worker): Hermes' ``<tool_call>``.
    tool_format: Annotated[str, Text(64)] = ""


@_register(0x17, limits.JOB_FRAME)
class Error(Message):
    """Terminal frame: the job failed.

    ``code`` is a ``protocol.errors.ErrorCode``: what went wrong, never how to
    show it. The frontend alone maps it to HTTP (``frontend.errors``), so the
    wire carries no status (version 02 dropped it).
    ``n_prompt_tokens`` and ``n_ctx`` are set with ``context_length_exceeded``
    (0 otherwise): llama.cpp's error body names both.
    """

    job_id: str
    code: str
    message: Annotated[str, _REASON]
    n_prompt_tokens: Annotated[int, COUNT] = 0
    n_ctx: Annotated[int, COUNT] = 0


# --- introspection -------------------------------------------------------------


@_register(0x20)
class Status(Message):
    """Frontend (or any tool) -> broker: send me the ledger."""

    request_id: Annotated[str, _ID]


@_register(0x21, limits.STATUS_REPLY)
class StatusReply(Message):
    """Broker -> asker: the ledger and the pool's totals (``Broker.snapshot``)."""

    request_id: str
    snapshot: PoolStatus


# --- slot actions (llama-server's POST /slots/{id}?action=) ---------------------

#: llama-server's slot actions; a frontend refuses any other with 400.
SLOT_ACTIONS = ("save", "restore", "erase")
#: llama.cpp's ``fs_validate_filename`` takes at most 255 bytes.
_SLOT_FILENAME = Text(255)


@_register(0x30)
class SlotAction(Message):
    """Frontend -> broker -> worker: save, restore or erase slot ``id_slot``'s
    KV sequence (``workers.model.slot_files``).

    The broker leases that slot for it as for a job (a busy slot gets
    NO_SLOT at once; an unknown one ERROR ``invalid_slot``), hands the frames
    to its worker unchanged, and frees the slot when SLOT_DONE passes.
    ``filename`` ("" for erase) is a bare name inside the worker's
    ``--slot-save-path``, checked there again; ``tenant`` is the caller's
    cache scope (``GenerationRequest.cache_tenant``): a save writes only
    that tenant's tokens and a restore loads only that tenant's file.
    """

    job_id: Annotated[str, _ID]
    id_slot: Annotated[int, COUNT]
    action: Annotated[str, OneOf(*SLOT_ACTIONS)]
    filename: Annotated[str, _SLOT_FILENAME] = ""
    tenant: Annotated[str, _ID] = ""
    request_id: Annotated[str, _ID] = ""


@_register(0x31)
class SlotDone(Message):
    """Worker -> broker -> frontend: how a SLOT_ACTION ended; its only frame.

    ``code`` "" : done, with ``n_tokens`` saved, restored or erased,
    ``n_bytes`` written or read and ``ms`` taken (llama-server's answer
    fields). Otherwise a ``protocol.errors.ErrorCode`` and ``message``
    (llama-server's words where it has them): the broker then frees the
    slot as for success, and counts no job (no request ran).
    """

    job_id: Annotated[str, _ID]
    action: Annotated[str, OneOf(*SLOT_ACTIONS)]
    n_tokens: Annotated[int, COUNT] = 0
    n_bytes: Annotated[int, COUNT] = 0
    ms: Annotated[float, NON_NEGATIVE] = 0.0
    code: Annotated[str, _ID] = ""
    message: Annotated[str, _REASON] = ""


TERMINAL = (Final, Error)
JOB_FRAMES = (Token, Final, Error)


def decode(frames: list[bytes]) -> Message:
    """Decode frames (without routing identity) into a typed message.

    Raises:
        MalformedMessage: wrong frame count, header, command, or body.
    """
    if len(frames) != 3:
        raise MalformedMessage(f"{len(frames)} frames, expected 3")
    header, command, body = frames
    if header != PROTOCOL_HEADER:
        raise MalformedMessage(f"bad protocol header {bytes(header[:16])!r}")
    cls = _BY_COMMAND.get(bytes(command))
    if cls is None:
        raise MalformedMessage(f"unknown command {bytes(command[:4])!r}")
    body_limits = cls.LIMITS
    if len(body) > body_limits.max_bytes:
        raise MalformedMessage(
            f"{cls.__name__} body of {len(body)} bytes is too large "
            f"(at most {body_limits.max_bytes})")
    kwargs = cls._UNPACK_KW
    if body_limits.max_containers is not None:
        budget = _ContainerBudget(body_limits.max_containers)
        kwargs = {**kwargs, "list_hook": budget, "object_hook": budget}
    try:
        fields = msgpack.unpackb(body, **kwargs)
    except MalformedMessage:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedMessage(f"bad msgpack body: {exc.__class__.__name__}") from None
    return cls.from_body(fields)


def job_id_tag(job_id: str) -> bytes:
    """How ``job_id`` opens a job frame's body on the wire: its msgpack form,
    right after the array header (for ``is_token_of``)."""
    return msgpack.packb(job_id)


#: A TOKEN body is a msgpack fixarray (header byte ``0x90 | n``) of at least
#: job_id and text, and at most every field.
_TOKEN_ARRAY_HEADERS = frozenset(
    0x90 | n for n in range(2, len(dataclasses.fields(Token)) + 1))


def is_token_of(frames: list[bytes], tag: bytes) -> bool:
    """Whether ``frames`` are a TOKEN of the job whose ``job_id_tag`` is
    ``tag``, by the header, the command byte and the body's first bytes alone.

    For the broker's relay, the one hot path that does not decode: the rest
    of the body is checked by the frontend, which decodes every frame anyway
    (BENCHMARKS.md section 13: decoding cost the broker ~a sixth of its CPU
    per frame). What is checked here is what routing needs: that the frame
    is a TOKEN and names the job the worker holds, so it can only ever reach
    that job's client.
    """
    if len(frames) != 3:
        return False
    header, command, body = frames
    return (command == Token.COMMAND and header == PROTOCOL_HEADER
            and len(body) > len(tag) and body[0] in _TOKEN_ARRAY_HEADERS
            and body.startswith(tag, 1))


def claimed_job_id(frames: list[bytes],
                   kinds: tuple[type[Message], ...] = JOB_FRAMES) -> str | None:
    """The job id a job frame's body opens with, without decoding the rest
    (None if it does not open with one): to end the job of a frame that
    failed to decode. ``kinds``: the commands that may claim one (``(Submit,)``
    for a SUBMIT that a broker or worker cannot read, answered with ERROR)."""
    if command_class(frames) not in kinds or len(frames) != 3:
        return None
    unpacker = msgpack.Unpacker(max_buffer_size=len(frames[2]) or 1,
                                max_str_len=limits.MAX_ID_CHARS * 4)
    try:
        unpacker.feed(frames[2])
        if unpacker.read_array_header() < 1:
            return None
        job_id = unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types
        return None
    return job_id if isinstance(job_id, str) else None


def command_class(frames: list[bytes]) -> type[Message] | None:
    """The message class that ``frames`` claim to be, by header and command
    byte alone, or None. For a message that failed to decode: a broken
    terminal frame must still end its job."""
    if len(frames) < 2 or frames[0] != PROTOCOL_HEADER:
        return None
    return _BY_COMMAND.get(bytes(frames[1]))


class _ContainerBudget:
    """msgpack's list and object hook: refuses a body with too many arrays
    and maps, as soon as one too many is built (the length limits bound one
    container, not how many there are)."""

    __slots__ = ("left",)

    def __init__(self, max_containers: int) -> None:
        self.left = max_containers

    def __call__(self, container):
        self.left -= 1
        if self.left < 0:
            raise MalformedMessage("too many arrays and maps in one body")
        return container


def all_message_classes() -> list[type[Message]]:
    """Every registered message class (for tests and docs)."""
    return list(_BY_COMMAND.values())
