"""One generation job's frames, from the broker's answer to the lease's end.

A job's frames were once read in three places: the setup in
``frontend.generation`` (the first frame), its collector for non-streamed
responses, and the SSE body. Each handled the terminal frame its own way, two
returned credit, three built the 504 for a silent worker, and every failure
on this side ended the lease as "error", the ending of an ERROR frame, so no
CANCEL went out and the slot stayed busy. ``Job`` now owns all of that: it
reads the frames with the frame timeout, returns credit for what the client
consumed, fills in the ``JobOutcome``, and ends the lease with a
``LeaseEnding`` that says whether the job is over at the broker. Its callers
only shape what it hands them: SSE events (``frontend.sse``) or one JSON body
(``frontend.generation.collect``).

A frame timeout is handed out as an ERROR frame with code ``timeout``, made
here, after the lease has ended with ``TIMEOUT`` (which sends CANCEL), so
every caller shows it like any other error.

Nothing here writes an HTTP header or a request-log field: a job says what
happened (``slot_id``, ``model``, its ``JobOutcome``, the lease's ending)
and the endpoint pipeline (``frontend.endpoint``) writes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from frontend.errors import ClientGone
from frontend.frame_merge import merged
from frontend.interfaces import FrameStream
from frontend.lease import LeaseEnding, SlotLease
from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import RequestDefaults, Timings, Usage

#: How often a job waiting for its slot asks whether its client is still there.
WAIT_POLL_S = 0.1

#: What the client reads when the worker sends nothing for the frame timeout.
TIMEOUT_MESSAGE = "no output from the worker in time"

#: How often a job waiting in the broker's queue says so again, with no
#: news (a streamed waiter's SSE comment: proxies time out a silent
#: stream, nginx's ``proxy_read_timeout`` after 60 s; llama-server pings
#: every 30 s).
WAITING_REMINDER_S = 15.0

#: A frame ``Job`` hands out: output, or the job's one terminal frame.
JobFrame = messages.Token | messages.Final | messages.Error


class JobOutcome:
    """What happened to one job, filled in as frames arrive (for logs and metrics)."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_s: list[float] = []
        self.finish_reason: str | None = None
        self.error_code: str | None = None
        #: From the FINAL frame; None if the job did not end with one.
        self.usage: Usage | None = None
        self.timings: Timings | None = None

    def saw_token(self) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.inter_token_s.append(now - self.last_token_at)
        self.last_token_at = now

    def saw_terminal(self, msg: messages.Message) -> None:
        if isinstance(msg, messages.Final):
            self.finish_reason = msg.finish_reason
            self.usage = msg.usage
            self.timings = msg.timings
        else:
            self.error_code = str(msg.code)


class Job:
    """The frames of one submitted job, and the lease they end.

    Args:
        lease: taken before SUBMIT; ended here, or by ``end``.
        stream: the job's frames, from ``BrokerClient.submit``.
        send: the broker link's ``send`` (for CREDIT).
        frame_timeout_s: longest silence before the job is given up.
        credit_batch_frames: consumed frames per CREDIT message.
        merge_frames_max: the most TOKEN frames, already waiting, that one
            ``next_frame`` hands out as one (``frontend.frame_merge``); 1
            hands out each as it came.
        outcome: filled in as frames arrive.
    """

    def __init__(
        self,
        lease: SlotLease,
        stream: FrameStream,
        *,
        send: Callable[[messages.Message], None],
        frame_timeout_s: float,
        credit_batch_frames: int,
        merge_frames_max: int,
        outcome: JobOutcome,
    ) -> None:
        self.lease = lease
        self.job_id = lease.job_id
        self.outcome = outcome
        self.slot_id: int | None = None
        self.model = ""
        #: The broker's last QUEUED for the job, if it waited for a slot.
        self.queued: messages.Queued | None = None
        #: Its worker's defaults for what the request left out (ACCEPTED's).
        self.defaults: RequestDefaults | None = None
        self._stream = stream
        self._send = send
        self._frame_timeout_s = frame_timeout_s
        self._credit_batch = max(1, credit_batch_frames)
        self._merge_max = max(1, merge_frames_max)
        self._pending: JobFrame | None = None
        #: A frame ``_merge_waiting`` took off the stream and did not merge:
        #: the next one ``_receive`` reads.
        self._held_back: messages.Message | None = None
        self._handed_out = 0
        self._credited = 0
        self._terminal_seen = False

    # --- setup ---------------------------------------------------------------------

    def answer(self, timeout_s: float,
               client_gone: Callable[[], bool] | None = None
               ) -> messages.Message | None:
        """The broker's answer to SUBMIT, or None if none came in time.

        ACCEPTED names the slot. NO_SLOT and ERROR end the lease: the broker
        holds nothing for this job, so there is nothing to cancel. QUEUED
        (the broker's wait for a slot) is no answer yet: it moves the
        deadline to the end of the wait it names. ``client_gone`` is asked
        every ``WAIT_POLL_S`` meanwhile.

        Raises:
            ClientGone: the client left; the lease ended as a disconnect,
                whose CANCEL takes the job out of the broker's queue.
        """
        return run_steps(self.answer_steps(timeout_s, client_gone))

    def answer_steps(self, timeout_s: float,
                     client_gone: Callable[[], bool] | None = None,
                     remind_s: float = WAITING_REMINDER_S):
        """``answer`` as a generator that yields this job at each step of a
        wait in the broker's queue: each QUEUED (``self.queued``: its
        position), and again every ``remind_s`` without one, so that a
        stream can tell its client it still waits (``frontend.queued_stream``);
        its return value is ``answer``'s."""
        deadline = time.monotonic() + timeout_s
        remind_at = None
        while True:
            left = deadline - time.monotonic()
            if remind_at is not None:
                left = min(left, remind_at - time.monotonic())
            msg = self._stream.get(max(0.0, min(left, WAIT_POLL_S)
                                       if client_gone else left))
            if msg is None:
                if client_gone is not None and client_gone():
                    self.lease.release(LeaseEnding.DISCONNECT)
                    raise ClientGone()
                if remind_at is not None and time.monotonic() >= remind_at:
                    remind_at = time.monotonic() + remind_s
                    yield self
                if time.monotonic() < deadline:
                    continue
            elif isinstance(msg, messages.Queued):
                self.queued = msg
                deadline = max(deadline, time.monotonic() + msg.wait_s + timeout_s)
                remind_at = time.monotonic() + remind_s
                yield self
                continue
            break
        if isinstance(msg, messages.Accepted):
            self.slot_id, self.model = msg.slot_id, msg.model
            self.defaults = msg.defaults
        elif isinstance(msg, (messages.NoSlot, messages.RateLimited)):
            self.lease.release(LeaseEnding.REFUSED)
        elif isinstance(msg, messages.Error):
            self._saw_terminal(msg)
        return msg

    def first_frame(self) -> JobFrame:
        """Wait for the worker's first frame and keep it for ``next_frame``.

        Part of setup: if it is an error, nothing was sent to the client yet,
        and the caller can still answer with an HTTP status.
        """
        self._pending = self._receive()
        return self._pending

    # --- streaming -----------------------------------------------------------------

    def next_frame(self) -> JobFrame:
        """The next frame for the client, waiting at most the frame timeout.

        Call it only once the previous frame was consumed (written to the
        client, or buffered): that is what the credit returned here means.
        After a FINAL or ERROR frame there is nothing more to ask for.
        """
        self._return_credit()
        msg, self._pending = self._pending, None
        if msg is None:
            if self._terminal_seen:
                raise RuntimeError(f"job {self.job_id} has already ended")
            msg = self._receive()
        if isinstance(msg, messages.Token):
            self._handed_out += 1
            msg = self._merge_waiting(msg)
        return msg

    def end(self, ending: LeaseEnding) -> bool:
        """End the lease from outside (disconnect, GC, a local failure).

        A no-op if the job already ended; True only for the call that ended it.
        """
        return self.lease.release(ending)

    # --- internals -------------------------------------------------------------------

    def _merge_waiting(self, msg: messages.Token) -> messages.Token:
        """``msg`` with the TOKEN frames that already wait behind it: a
        client that is behind gets its backlog as one event. The first
        frame that does not merge (a terminal one, an embedding's) is held
        back for the next call, unread until then, so that the job ends
        only once the text before its end was handed out."""
        n_frames = 1
        while n_frames < self._merge_max:
            waiting = self._stream.get(0.0)
            if waiting is None:
                break
            if isinstance(waiting, messages.Token):
                both = merged(msg, waiting)
                if both is not None:
                    self.outcome.saw_token()
                    self._handed_out += 1
                    msg, n_frames = both, n_frames + 1
                    continue
            if isinstance(waiting, (messages.Token, *messages.TERMINAL)):
                self._held_back = waiting
                break
            # Anything else is not ours (as in ``_receive``).
        return msg

    def _return_credit(self) -> None:
        # Everything handed out before this call has been consumed.
        owed = self._handed_out - self._credited
        if owed >= self._credit_batch and not self.lease.released:
            self._send(messages.Credit(self.job_id, owed))
            self._credited = self._handed_out

    def _receive(self) -> JobFrame:
        while True:
            msg, self._held_back = self._held_back, None
            if msg is None:
                msg = self._stream.get(self._frame_timeout_s)
            if msg is None:
                msg = messages.Error(self.job_id, ErrorCode.TIMEOUT, TIMEOUT_MESSAGE)
                self._terminal_seen = True
                self.outcome.saw_terminal(msg)
                self.lease.release(LeaseEnding.TIMEOUT)
                return msg
            if isinstance(msg, messages.Token):
                self.outcome.saw_token()
                return msg
            if isinstance(msg, messages.TERMINAL):
                self._saw_terminal(msg)
                return msg
            # ACCEPTED was consumed during setup; anything else is not ours.

    def _saw_terminal(self, msg: messages.Final | messages.Error) -> None:
        self._terminal_seen = True
        self.outcome.saw_terminal(msg)
        if isinstance(msg, messages.Final):
            self.lease.release(LeaseEnding.EOF)
        else:
            self.lease.release(LeaseEnding.REMOTE_ERROR)


def run_steps(steps):
    """Drive a generator of waiting steps (``Job.answer_steps``,
    ``frontend.generation.start_job_steps``) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
