"""How large a message may be: per command, in bytes, containers and chars.

A peer's bytes cost the receiver work before anything checks them: libzmq
buffers the whole frame, and msgpack builds every object in it before
``from_body`` looks at one. A valid 16 MB body of 16 million empty arrays
used to freeze the broker for seconds (and a 1 GB frame took it to 2 GB),
so every limit below is what the protocol *needs*, not what a transport
allows:

* ``ZMQ_MAXMSGSIZE`` on every socket: the largest frame the peer on the
  other side may legitimately send. libzmq drops the connection of a peer
  that exceeds it, before buffering the frame.
* A byte ceiling per command, checked before unpacking.
* msgpack's ``max_str_len``/``max_bin_len``/``max_array_len``/
  ``max_map_len``/``max_ext_len``, per command, so a length header that
  claims more is refused before anything is built (the protocol uses no ext
  at all; a bin, used by no field either, is left to the field check).
* A cap on the number of arrays and maps in one body (``max_containers``),
  counted as msgpack builds them: the length limits bound one array, not how
  many there are, and the 16 M empty arrays were many small ones.
* Length caps on the strings the broker keeps (host and worker names, job
  ids), so a registration cannot park 10 KB of name in the ledger.

Worst case per message, then, is bounded by its command's byte ceiling: at
most one scalar per byte. SUBMIT is the one large command a peer sends (it
carries the prompt), which is why its ceiling is the only large one.
"""

from __future__ import annotations

import dataclasses

KIB = 1024
MIB = 1024 * KIB

#: The largest SUBMIT body. It carries the prompt (the frontend's HTTP body,
#: 1 MiB by default: about 250 k tokens of text, more than any context we
#: run) plus its token ids (at most one per context position, <= 5 bytes
#: each) and prefix fingerprints (``protocol.prefix``, 128 at most). 2 MiB
#: holds the default body with all of that to spare; a frontend refuses with
#: 413 a request whose SUBMIT would be larger, so nothing valid is dropped
#: here. At one scalar per byte, decoding the worst 2 MiB costs ~0.1 s.
MAX_SUBMIT_BYTES = 2 * MIB

#: The largest frame output of a job may need (TOKEN, FINAL, ERROR): a
#: held-back stop-string tail or an engine's message is derived from the
#: request, so it is never larger than the SUBMIT it answers.
MAX_JOB_FRAME_BYTES = MAX_SUBMIT_BYTES

#: The broker's STATUS reply: a ledger of at most ``--max-workers`` slots,
#: each at most ~1.3 KiB with every string at its cap. 16 MiB holds more than
#: 10 000 worst-case slots (the broker refuses a larger --max-workers).
MAX_STATUS_REPLY_BYTES = 16 * MIB
#: A bound on one slot's share of a STATUS reply (strings at their caps).
MAX_SLOT_STATUS_BYTES = 1536

#: Everything else (HELLO, READY, HEARTBEAT with progress, CANCEL...) is a
#: handful of short fields.
MAX_SMALL_BODY_BYTES = 64 * KIB

#: Token ids in one prompt: more than any context we serve (256 k).
MAX_PROMPT_TOKENS = 256 * KIB
#: Chat turns in one request. A 1 MiB body holds ~35 k minimal turns.
MAX_CHAT_MESSAGES = 64 * KIB
#: Inputs in one embedding request (OpenAI's limit). Each is two containers
#: (its record and its token list), well inside SUBMIT's container budget,
#: which a request never spends on chat turns at the same time.
MAX_EMBEDDING_INPUTS = 2048

#: String caps for what the broker keeps per peer and per job.
MAX_HOST_CHARS = 255  # a DNS name
#: A worker's name (default ``host:pid``), a model label (a file's name),
#: an engine's name.
MAX_NAME_CHARS = 512
#: Aliases one worker may give its model (``--alias``), and the distinct
#: models one broker's ledger holds (a worker of one more is refused), so
#: the models of a STATUS reply stay small beside its slots.
MAX_ALIASES = 8
MAX_MODELS = 64
#: Job and request ids (frontends use 32 hex digits).
MAX_ID_CHARS = 128
#: What a SUBMIT may show of its API key (the last 4 characters, or "-").
MAX_KEY_LABEL_CHARS = 8
#: A named key's name (a keys file's ``name``: ``frontend.key_records``).
MAX_KEY_NAME_CHARS = 64
#: Named keys a broker keeps usage for; beyond, usage is summed under
#: ``workers.broker.key_limits.OTHER`` (a frontend cannot grow it unbounded).
MAX_KEY_NAMES = 1024
#: A SUBMIT's W3C trace context (``protocol.payloads.TraceContext``):
#: ``traceparent`` is 55 characters in version 00; ``tracestate`` is what
#: W3C asks every hop to pass on at least.
MAX_TRACEPARENT_CHARS = 128
MAX_TRACESTATE_CHARS = 512
#: The most llama.cpp threads (or pool cores) a message may name; far above
#: any real host, low enough that a hostile value allocates nothing silly.
MAX_THREADS = 4096
#: An ERROR's or DISCONNECT's human-readable text.
MAX_REASON_CHARS = 4096
#: Most ``logit_bias`` entries in one request (each is a container).
MAX_LOGIT_BIAS_ENTRIES = 1024
#: Most log-probability entries one TOKEN or FINAL carries: the tokens held
#: back behind a possible stop-string prefix go out together. The frontend
#: bounds that by refusing logprobs with a stop string longer than
#: ``MAX_STOP_CHARS_WITH_LOGPROBS`` (a character is at most 4 tokens).
MAX_STOP_CHARS_WITH_LOGPROBS = 256
MAX_LOGPROB_ENTRIES_PER_FRAME = 4 * MAX_STOP_CHARS_WITH_LOGPROBS + 64

#: libzmq ``ZMQ_MAXMSGSIZE`` per socket: the largest frame each side sends.
#: Frontends send SUBMIT at most; workers send job frames at most.
MAX_FRAME_FROM_FRONTEND = MAX_SUBMIT_BYTES
MAX_FRAME_FROM_WORKER = MAX_JOB_FRAME_BYTES
#: The broker sends SUBMIT to workers and STATUS_REPLY to frontends.
MAX_FRAME_FROM_BROKER = max(MAX_SUBMIT_BYTES, MAX_STATUS_REPLY_BYTES)


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    """What one command's body may contain, enforced while decoding it.

    ``max_containers`` None means uncounted: a small body (64 KiB) cannot
    hold enough containers to matter, and counting costs a Python call per
    container on the hot path (TOKEN).
    """

    max_bytes: int = MAX_SMALL_BODY_BYTES
    #: Longest array: a record's fields, or a list field's items.
    max_array_len: int = 64
    max_map_len: int = 64
    max_containers: int | None = None

    def unpack_kwargs(self) -> dict:
        """msgpack ``unpackb`` keyword arguments for these limits."""
        return {
            "max_str_len": self.max_bytes,
            # No field is binary; a bin is refused by the field check, which
            # names the field. It is one object, so letting it reach that
            # check costs nothing the byte ceiling does not already bound.
            "max_bin_len": self.max_bytes,
            "max_ext_len": 0,  # nor extension types
            "max_array_len": self.max_array_len,
            "max_map_len": self.max_map_len,
        }


SMALL = BodyLimits()
#: TOKEN, FINAL (usage and timings maps) and ERROR; their logprobs lists.
JOB_FRAME = BodyLimits(max_bytes=MAX_JOB_FRAME_BYTES,
                       max_array_len=MAX_LOGPROB_ENTRIES_PER_FRAME)
SUBMIT = BodyLimits(
    max_bytes=MAX_SUBMIT_BYTES,
    max_array_len=max(MAX_PROMPT_TOKENS, MAX_CHAT_MESSAGES),
    # No SUBMIT field is a map today; a newer peer's extra trailing fields
    # may be (they are ignored), and every map counts as a container.
    max_map_len=64,
    # The submit, request, sampling and five lists, plus one per chat turn
    # and one per logit_bias entry.
    max_containers=MAX_CHAT_MESSAGES + MAX_LOGIT_BIAS_ENTRIES + 16,
)
STATUS_REPLY = BodyLimits(
    max_bytes=MAX_STATUS_REPLY_BYTES,
    max_array_len=MAX_STATUS_REPLY_BYTES // MAX_SLOT_STATUS_BYTES,
    # The counters map: a closed set of names (a few per error code).
    max_map_len=4096,
    # Two per slot (the slot and its progress), plus the totals, plus three
    # per model (its record, aliases and capabilities) and nine per model's
    # totals (the record, and two histograms of four lists each).
    max_containers=2 * (MAX_STATUS_REPLY_BYTES // MAX_SLOT_STATUS_BYTES) + 64
    + 12 * MAX_MODELS,
)

#: CACHE_REPORT (worker -> broker): the fingerprint lists of at most this many
#: prompt states (the live sequence and the most recently used cached ones),
#: each at most ``protocol.prefix.MAX_BLOCKS`` (128) fingerprints. A worker
#: with more states reports the most recent; the rest are still restored
#: when a prompt reaches that worker, only not routed to.
MAX_REPORTED_STATES = 128
#: 128 states x 128 fingerprints x at most 5 bytes each, plus the figures.
MAX_CACHE_REPORT_BYTES = 128 * KIB
CACHE_REPORT = BodyLimits(
    max_bytes=MAX_CACHE_REPORT_BYTES,
    max_array_len=max(MAX_REPORTED_STATES, 128),
    max_containers=MAX_REPORTED_STATES + 8,
)
