"""The frontend's two shared interfaces, declared once.

* ``BrokerClient``: what a request thread needs of "the broker". One
  ``BrokerLink`` (``frontend.broker_link``) is one; so is a ``BrokerPool``
  over several (``frontend.broker_pool``), which routes each job to one of
  its links. Its ``submit`` hands back a ``FrameStream``: ``JobStream`` for
  a link, ``PoolJobStream`` for a pool.
* ``Shaper``: what turns one job's frames into the answer a client reads.
  OpenAI's ``ResponseShaper`` (``frontend.openai_format``) and llama.cpp's
  ``NativeShaper`` (``frontend.native_format``) are the two;
  ``frontend.sse.EventStreamBody`` streams with either, and
  ``frontend.endpoint.GenerationEndpoint`` answers whole with either.

Structural (``typing.Protocol``): the implementations do not inherit from
these, and a test's stand-in link qualifies by having the methods.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from protocol import messages
from protocol.payloads import (
    GenerationRequest,
    KeyPolicy,
    PoolStatus,
    TokenLogprob,
    TraceContext,
)


@dataclasses.dataclass(frozen=True)
class JobOrigin:
    """Who asked for a job, as the broker's log lines name it (a worker that
    died during it): the HTTP request's id and what may be shown of its key
    (``frontend.auth.key_suffix``). Carried in SUBMIT; changes no output."""

    request_id: str = ""
    key: str = ""
    #: The frontend's span for the job (``frontend.request_trace``); None:
    #: not traced.
    trace: TraceContext | None = None
    #: The API key as the broker's fair wait tells keys apart (a keyed hash:
    #: ``frontend.cache_scope.CacheScope.client``), and the request's own
    #: cap on that wait (``X-Max-Wait-S``; 0: the broker's).
    client: str = ""
    max_wait_s: float = 0.0
    #: A named key's limits, for the broker to enforce (``key_records``).
    key_policy: KeyPolicy | None = None


class FrameStream(Protocol):
    """One submitted job's frames, in arrival order."""

    job_id: str

    @property
    def accepted(self) -> bool:
        """True once a broker's ACCEPTED for the job has arrived."""
        ...

    def get(self, timeout_s: float) -> messages.Message | None:
        """The next frame, or None after ``timeout_s`` without one."""
        ...


class BrokerClient(Protocol):
    """The broker as request threads use it: jobs, their control messages,
    and the ledger. Thread-safe; ``start`` is lazy, idempotent and runs after
    gunicorn's fork."""

    def start(self) -> BrokerClient:
        ...

    def close(self) -> None:
        ...

    def send(self, msg: messages.Message) -> None:
        """Send CANCEL or CREDIT (or STATUS) towards the job's broker."""
        ...

    def submit(self, job_id: str, request: GenerationRequest,
               prefix_blocks: list[int] | None = None,
               id_slot: int = -1, origin: JobOrigin | None = None) -> FrameStream:
        """Open the job's stream and send SUBMIT (``origin``: for the
        broker's log).

        Raises:
            PayloadTooLarge: the SUBMIT would exceed the wire's ceiling.
        """
        ...

    def slot_action(self, msg: messages.SlotAction) -> FrameStream:
        """Open the slot action's stream and send it to the broker of its
        slot (``frontend.slot_actions``)."""
        ...

    def forget(self, job_id: str) -> None:
        """Stop routing the job's frames (late ones are dropped)."""
        ...

    def status(self, timeout_s: float, max_age_s: float = 0.0
               ) -> PoolStatus | None:
        """The ledger, or None if no broker answered within ``timeout_s``."""
        ...

    @property
    def last_heard(self) -> float:
        """monotonic time a broker was last heard from (0: never)."""
        ...

    def broker_alive(self) -> bool:
        ...

    @property
    def malformed_dropped(self) -> int:
        ...

    @property
    def broker_losses(self) -> int:
        ...


class Shaper(Protocol):
    """One request's answer, built from its job's frames."""

    def text_frame_event(self, msg: messages.Token) -> bytes:
        """The SSE event(s) for one TOKEN frame (maybe none: ``b""``)."""
        ...

    def final_frame_events(self, msg: messages.Final) -> bytes:
        """The stream's last events, for its FINAL frame."""
        ...

    def error_event(self, code: str, message: str) -> bytes:
        """The event that ends a stream with an error (no ``[DONE]``)."""
        ...

    def whole_answer(self, text: str, final: messages.Final,
                     entries: list[TokenLogprob]) -> dict:
        """The JSON body of a non-streamed answer: the job's whole text, its
        FINAL frame and its log-probability entries."""
        ...
