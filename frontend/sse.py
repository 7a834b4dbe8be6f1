"""The streamed response body: a WSGI iterable that owns the slot lease.

gunicorn pulls one event at a time and writes it to the client. When the
client is gone, the write fails and gunicorn calls ``close()``; if a thread
dies or the body is dropped, ``__del__`` runs. Either way the lease is
released (and CANCEL sent) exactly once (see ``frontend.lease``).

Credit: each ``__next__`` call means the previous event was written to the
socket, so frames handed out so far have been consumed. The body returns
credit to the worker in batches; a client that stops reading stops the
credit, and the worker pauses (``workers.model.worker.ActiveJob``).
"""

from __future__ import annotations

import time

from frontend.broker_link import JobStream
from frontend.lease import SlotLease
from frontend.openai_format import ResponseShaper
from protocol import messages


class JobOutcome:
    """What happened to one job, filled in as frames arrive (for logs and metrics)."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_s: list[float] = []
        self.finish_reason: str | None = None
        self.error_code: str | None = None
        self.usage: dict = {}
        self.timings: dict = {}

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
            self.error_code = msg.code


class EventStreamBody:
    """Yields SSE events for one job until its terminal frame."""

    def __init__(
        self,
        lease: SlotLease,
        stream: JobStream,
        shaper: ResponseShaper,
        first: messages.Message,
        *,
        frame_timeout_s: float,
        credit_batch_frames: int,
        send,
        outcome: JobOutcome,
    ) -> None:
        self._lease = lease
        self._stream = stream
        self._shaper = shaper
        self._pending: messages.Message | None = first
        self._frame_timeout_s = frame_timeout_s
        self._credit_batch = max(1, credit_batch_frames)
        self._send = send
        self.outcome = outcome
        self._handed_out = 0
        self._credited = 0
        self._done = False

    def __iter__(self) -> EventStreamBody:
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            self._return_credit()
            return self._next_event()
        except BaseException:
            self._done = True
            self._lease.release("error")
            raise

    def _return_credit(self) -> None:
        # Everything handed out before this call has been written out.
        owed = self._handed_out - self._credited
        if owed >= self._credit_batch:
            self._send(messages.Credit(self._lease.job_id, owed))
            self._credited = self._handed_out

    def _next_event(self) -> bytes:
        while True:
            msg, self._pending = self._pending, None
            if msg is None:
                msg = self._stream.get(self._frame_timeout_s)
            if msg is None:
                msg = messages.Error(self._lease.job_id, "timeout",
                                     "no output from the worker in time", 504)
            if isinstance(msg, messages.Token):
                self._handed_out += 1
                self.outcome.saw_token()
                return self._shaper.text_event(msg.text)
            if isinstance(msg, messages.Final):
                self._done = True
                self.outcome.saw_terminal(msg)
                self._lease.release("eof")
                return self._shaper.final_events(
                    msg.text, msg.finish_reason, msg.usage, msg.timings
                )
            if isinstance(msg, messages.Error):
                self._done = True
                self.outcome.saw_terminal(msg)
                self._lease.release("error")
                return self._shaper.error_event(msg.code, msg.message, msg.status)
            # ACCEPTED was consumed during setup; anything else is not ours.

    def close(self) -> None:
        """Called by the WSGI server after the last write or a failed one."""
        self._done = True
        self._lease.release("disconnect")

    def __del__(self) -> None:
        lease = getattr(self, "_lease", None)
        if lease is not None:
            lease.release("gc")
