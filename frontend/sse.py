"""The streamed response body: a WSGI iterable that owns the job, and its lease.

gunicorn pulls one event at a time and writes it to the client. When the
client is gone, the write fails and gunicorn calls ``close()``; if a thread
dies or the body is dropped, ``__del__`` runs. Either way the lease is
released (and CANCEL sent) exactly once (see ``frontend.lease``).

The frames themselves, credit and the lease's other endings belong to
``frontend.job.Job``; this body only turns each frame into SSE bytes. Credit:
each ``__next__`` call means the previous event was written to the socket,
so asking the job for the next frame is what returns credit to the worker. A
client that stops reading stops the credit, and the worker pauses
(``workers.model.active_job.ActiveJob``).
"""

from __future__ import annotations

import socket

import falcon

from frontend.interfaces import Shaper
from frontend.job import Job
from frontend.lease import LeaseEnding
from protocol import messages


class EventStreamBody:
    """Yields SSE events for one job until its terminal frame."""

    def __init__(self, job: Job, shaper: Shaper) -> None:
        self._job = job
        self._shaper = shaper
        self.outcome = job.outcome
        self._done = False

    def __iter__(self) -> EventStreamBody:
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            msg = self._job.next_frame()
            if isinstance(msg, messages.Token):
                return self._shaper.text_frame_event(msg)
            self._done = True
            if isinstance(msg, messages.Final):
                return self._shaper.final_frame_events(msg)
            return self._shaper.error_event(msg.code, msg.message)
        except BaseException:
            # Failed here, not at the worker: the job may still be running.
            self._done = True
            self._job.end(LeaseEnding.LOCAL_ERROR)
            raise

    def close(self) -> None:
        """Called by the WSGI server after the last write or a failed one."""
        self._done = True
        self._job.end(LeaseEnding.DISCONNECT)

    def __del__(self) -> None:
        job = getattr(self, "_job", None)
        if job is not None:
            job.end(LeaseEnding.GC)


def tune_stream_socket(req: falcon.Request, sndbuf_bytes: int) -> None:
    """Make a streaming connection send each event at once, and buffer little.

    * ``TCP_NODELAY``: gunicorn writes the headers and each event separately.
      With Nagle's algorithm a small write waits for the ACK of the previous
      one, which the client delays (up to 40 ms): the first token would
      arrive 40 ms late, and later ones bunched.
    * ``SO_SNDBUF``: credit-based flow control only sees a slow client once
      writes block. Linux's send-buffer autotuning can let a loopback or LAN
      socket absorb megabytes first; capping it makes a client that stops
      reading pause its worker after a bounded amount of output.
    """
    sock = req.env.get("gunicorn.socket")
    if sock is None:
        return  # not under gunicorn (in-process tests): nothing to tune
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sndbuf_bytes > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf_bytes)
    except OSError:
        pass  # a Unix socket (behind a local proxy): no TCP options to set


def stream_answer(req: falcon.Request, resp: falcon.Response, job: Job,
                  shaper: Shaper, sndbuf_bytes: int) -> None:
    """Answer with the job's events; from here on the body owns the job, and
    with it the lease."""
    stream_body(req, resp, EventStreamBody(job, shaper), sndbuf_bytes)


def stream_body(req: falcon.Request, resp: falcon.Response, body,
                sndbuf_bytes: int) -> None:
    """Answer with an SSE body (an iterable of events that owns its job:
    ``EventStreamBody``, ``frontend.queued_stream.QueuedStreamBody``)."""
    tune_stream_socket(req, sndbuf_bytes)
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = body
