"""Running one generation job from a request thread: setup, then hand-over.

``start_job_steps`` is the setup phase: it takes the lease, submits, and
waits for the broker's answer and the worker's first frame (a streamed job
that waits in the broker's queue is answered meanwhile: it yields each step
of the wait, ``frontend.queued_stream``). Any failure in here
releases the lease before the exception leaves (DESIGN.md: setup failures
release too), and an error the worker or broker reported becomes an HTTP
status, since nothing was sent yet. On success the caller moves the ``Job``
(which owns the lease) into a response body (``EventStreamBody``) or drains
it with ``collect``.

What happened is returned, never written: the job names its slot and model,
its ``JobOutcome`` (from ``new_outcome``) fills in as frames arrive, and
``on_release`` hears the lease's ending. The HTTP headers and the request's
log record are the endpoint pipeline's (``frontend.endpoint``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from frontend.errors import (
    ClientLeft,
    NoSlotAvailable,
    RateLimitExceeded,
    Unavailable,
    UpstreamError,
)
from frontend.interfaces import BrokerClient, JobOrigin
from frontend.job import Job, JobOutcome
from frontend.lease import LeaseEnding, SlotLease
from frontend.tracing import job_trace
from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest, TokenLogprob
from protocol.prefix import prefix_blocks


def start_job_steps(
    link: BrokerClient,
    generation: GenerationRequest,
    *,
    submit_timeout_s: float,
    frame_timeout_s: float,
    credit_batch_frames: int,
    merge_frames_max: int,
    new_outcome: Callable[[], JobOutcome] = JobOutcome,
    on_release: Callable[[SlotLease], None] | None = None,
    id_slot: int = -1,
    origin: JobOrigin | None = None,
    client_gone: Callable[[], bool] | None = None,
):
    """Submit ``generation`` and wait for its first frame: a generator that
    yields the job at each step of a wait in the broker's queue
    (``Job.answer_steps``) and returns the started job. ``run_steps`` drives
    it to its end; a stream answers while its job waits
    (``frontend.queued_stream``). Closed mid-wait, its lease ends as a setup
    failure (CANCEL), unless its owner ended it first.

    ``client_gone`` is asked while the job waits for a slot (the broker's
    queue): a client that left ends it there (``ClientGone``).

    ``id_slot`` other than -1 asks the broker for that one slot. A job whose
    worker died before its first token (``worker_died`` as the first frame:
    nothing was sent to the client) is submitted once more, to whichever
    idle worker a broker picks; if that worker dies too, the error is
    ``worker_crashed`` and there is no third try, so one prompt that
    crashes workers costs the pool two of them, not all. ``new_outcome``
    gives each try its own outcome (one per lease).

    Raises:
        NoSlotAvailable: the broker refused (every slot busy).
        RateLimitExceeded: the broker refused: the key is over a limit.
        UpstreamError: the broker, the worker or the link reported an error,
            or no answer or first frame came in time.
        Unavailable: the broker answered something that is no answer.
    """
    def attempt():
        return (yield from _submit_steps(
            link, generation, submit_timeout_s=submit_timeout_s,
            frame_timeout_s=frame_timeout_s,
            credit_batch_frames=credit_batch_frames,
            merge_frames_max=merge_frames_max, outcome=new_outcome(),
            on_release=on_release, id_slot=id_slot, origin=origin,
            client_gone=client_gone))

    try:
        return (yield from attempt())
    except UpstreamError as exc:
        if exc.code != ErrorCode.WORKER_DIED:
            raise
        first_death = exc
    try:
        return (yield from attempt())
    except UpstreamError as exc:
        if exc.code != ErrorCode.WORKER_DIED:
            raise first_death from None  # no second worker: the first error
        raise UpstreamError(
            ErrorCode.WORKER_CRASHED,
            "the model worker died before the first token, and so did the "
            "worker the request was retried on; it is not tried again") from None
    except (NoSlotAvailable, RateLimitExceeded):
        raise first_death from None


def _submit_steps(
    link: BrokerClient,
    generation: GenerationRequest,
    *,
    submit_timeout_s: float,
    frame_timeout_s: float,
    credit_batch_frames: int,
    merge_frames_max: int,
    outcome: JobOutcome,
    on_release: Callable[[SlotLease], None] | None,
    id_slot: int,
    origin: JobOrigin | None = None,
    client_gone: Callable[[], bool] | None = None,
):
    """One try of ``start_job_steps``: a lease, SUBMIT, the answer, the first frame
    (a generator of the wait's steps, returning the job)."""
    trace = job_trace(id_slot)  # None when tracing is off
    if trace is not None:
        on_release = trace.releasing(on_release, outcome)
    lease = SlotLease(uuid.uuid4().hex, link.send, link.forget, on_release)
    try:
        tokens = generation.prompt_tokens
        # In the request's tenant's scope, as the workers report theirs.
        blocks = prefix_blocks(tokens, generation.cache_tenant) if tokens else None
        if trace is not None:
            origin = trace.origin(origin, lease.job_id)
        stream = link.submit(lease.job_id, generation, blocks, id_slot, origin)
        job = Job(lease, stream, send=link.send, frame_timeout_s=frame_timeout_s,
                  credit_batch_frames=credit_batch_frames,
                  merge_frames_max=merge_frames_max, outcome=outcome)
        answer = yield from job.answer_steps(submit_timeout_s, client_gone)
        if trace is not None:
            trace.answered(answer, stream, job.queued)
        if answer is None:
            raise UpstreamError(ErrorCode.BROKER_UNREACHABLE,
                                "the broker did not answer")
        if isinstance(answer, messages.NoSlot):
            raise NoSlotAvailable(answer.retry_after_s)
        if isinstance(answer, messages.RateLimited):
            raise RateLimitExceeded(answer)
        if isinstance(answer, messages.Error):
            raise UpstreamError.from_frame(answer)
        if not isinstance(answer, messages.Accepted):
            raise Unavailable(ErrorCode.BROKER_UNREACHABLE,
                              "unexpected answer from the broker")
        first = job.first_frame()
        if trace is not None:
            trace.first_frame(first)
        if isinstance(first, messages.Error):
            raise UpstreamError.from_frame(first)
        return job
    except BaseException:
        lease.release(LeaseEnding.SETUP_FAILED)
        raise


#: How often a non-streamed job looks at its client while tokens arrive: a
#: poll of the socket costs a few microseconds, a token tens of them or more.
CLIENT_CHECK_INTERVAL_S = 0.05


def collect(job: Job, client_gone: Callable[[], bool] = lambda: False
            ) -> tuple[str, messages.Final, list[TokenLogprob]]:
    """Read a job to its end for a non-streamed response.

    The lease ends on every path out of here. Each frame is consumed as soon
    as it is buffered, so credit goes back as fast as frames arrive; the text
    (and the log-probability entries, one per token when asked for) is
    bounded by ``max_tokens`` and the context size. ``client_gone`` is asked
    between frames (at most every ``CLIENT_CHECK_INTERVAL_S``): a client
    that has closed its connection ends the lease as a disconnect, which
    cancels the job, as a stream's does.

    Raises:
        ClientLeft: the client closed its connection.
    """
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    next_check = time.monotonic() + CLIENT_CHECK_INTERVAL_S
    try:
        while True:
            msg = job.next_frame()
            if isinstance(msg, messages.Token):
                parts.append(msg.text)
                logprobs += msg.logprobs
                if time.monotonic() >= next_check:
                    if client_gone():
                        job.end(LeaseEnding.DISCONNECT)
                        raise ClientLeft()
                    next_check = time.monotonic() + CLIENT_CHECK_INTERVAL_S
            elif isinstance(msg, messages.Final):
                parts.append(msg.text)
                logprobs += msg.logprobs
                return "".join(parts), msg, logprobs
            else:
                raise UpstreamError.from_frame(msg)
    finally:
        # A no-op after FINAL, ERROR or a timeout; otherwise something failed
        # here while the worker is still running.
        job.end(LeaseEnding.LOCAL_ERROR)
