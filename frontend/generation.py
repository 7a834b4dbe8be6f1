"""Running one generation job from a request thread: setup, then hand-over.

``start_job`` is the setup phase: it takes the lease, submits, and waits for
the broker's answer and the worker's first frame. Any failure in here
releases the lease before the exception leaves (DESIGN.md: setup failures
release too). On success the caller moves the lease into a response body
(``EventStreamBody``) or drains it with ``collect``.
"""

from __future__ import annotations

import dataclasses
import uuid

from frontend.broker_link import BrokerLink, JobStream
from frontend.errors import NoSlotAvailable, Unavailable, UpstreamError
from frontend.lease import SlotLease
from frontend.sse import JobOutcome
from protocol import messages
from protocol.payloads import GenerationRequest
from protocol.prefix import prefix_blocks


@dataclasses.dataclass
class StartedJob:
    lease: SlotLease
    stream: JobStream
    first: messages.Message  # the worker's first TOKEN / FINAL / ERROR
    slot_id: int
    model: str
    outcome: JobOutcome


def start_job(
    link: BrokerLink,
    generation: GenerationRequest,
    *,
    submit_timeout_s: float,
    frame_timeout_s: float,
    outcome: JobOutcome | None = None,
    on_release=None,
) -> StartedJob:
    job_id = uuid.uuid4().hex
    outcome = outcome or JobOutcome()
    lease = SlotLease(job_id, link.send, link.forget, on_release)
    try:
        tokens = generation.prompt_tokens
        stream = link.submit(job_id, generation,
                             prefix_blocks(tokens) if tokens else None)
        answer = stream.get(submit_timeout_s)
        if answer is None:
            raise Unavailable("the broker did not answer", code="broker_unreachable")
        if isinstance(answer, messages.NoSlot):
            lease.release("refused")
            raise NoSlotAvailable(answer.retry_after_s)
        if isinstance(answer, messages.Error):
            lease.release("error")
            raise UpstreamError(answer.status, answer.code, answer.message)
        if not isinstance(answer, messages.Accepted):
            raise Unavailable("unexpected answer from the broker")
        first = stream.get(frame_timeout_s)
        if first is None:
            raise UpstreamError(504, "timeout", "no output from the worker in time")
        if isinstance(first, messages.Error):
            # Nothing was sent yet, so the client gets a real HTTP status.
            outcome.saw_terminal(first)
            lease.release("error")
            raise UpstreamError(first.status, first.code, first.message)
        return StartedJob(
            lease, stream, first, answer.slot_id, answer.model, outcome
        )
    except BaseException:
        lease.release("setup_failed")
        raise


def collect(
    job: StartedJob, link: BrokerLink, frame_timeout_s: float, credit_batch_frames: int
) -> tuple[str, messages.Final]:
    """Read a job to its end for a non-streamed response.

    The lease is released on every path out of here. Credit goes back as fast
    as frames arrive: the text is buffered here, and it is bounded by
    ``max_tokens`` and the context size.
    """
    parts: list[str] = []
    msg = job.first
    uncredited = 0
    try:
        while True:
            if isinstance(msg, messages.Token):
                job.outcome.saw_token()
                parts.append(msg.text)
                uncredited += 1
                if uncredited >= credit_batch_frames:
                    link.send(messages.Credit(job.lease.job_id, uncredited))
                    uncredited = 0
            elif isinstance(msg, messages.Final):
                job.outcome.saw_terminal(msg)
                job.lease.release("eof")
                parts.append(msg.text)
                return "".join(parts), msg
            elif isinstance(msg, messages.Error):
                job.outcome.saw_terminal(msg)
                job.lease.release("error")
                raise UpstreamError(msg.status, msg.code, msg.message)
            msg = job.stream.get(frame_timeout_s)
            if msg is None:
                raise UpstreamError(504, "timeout", "no output from the worker in time")
    finally:
        job.lease.release("setup_failed")
