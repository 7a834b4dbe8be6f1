"""The slot lease: the frontend's claim on one job's slot (DESIGN.md, seed 000).

The responder takes the lease when it submits. If setup fails, the responder
releases it. Once the stream is accepted, the lease moves into the response
body and ends with it: at EOF, on a terminal error, or when the body is closed
or garbage-collected unread (client disconnect). These are endings of one
resource, so ``release`` is idempotent: whichever path comes first releases,
the rest find nothing to do.

Releasing the lease does not free the remote slot by itself. What it must do
depends on where the job ended, so each ending says so (``LeaseEnding``):
when the broker already passed on the job's terminal frame or refused it,
there is nothing left to stop; after any failure on this side (a frame
timeout, an exception while streaming, a disconnect) the worker is still
computing, and release sends CANCEL. The broker frees the slot when the
worker acknowledges with its terminal frame.

One word once covered both "the worker sent ERROR" and "something failed
here", and a local failure was taken for a remote one: no CANCEL, and the
slot stayed busy until the worker finished by itself. The endings are
therefore an enum that knows which side ended the job.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from protocol import messages


class LeaseEnding(str, enum.Enum):
    """How a lease ended. The value is the ``ending`` label of metrics and logs."""

    #: The job's FINAL frame arrived.
    EOF = "eof"
    #: The job's ERROR frame arrived (from the worker, the broker, or the
    #: broker link when it lost the broker). The label predates the split
    #: into remote and local errors and is kept for dashboards.
    REMOTE_ERROR = "error"
    #: The broker answered NO_SLOT: no slot was ever taken.
    REFUSED = "refused"
    #: No frame came within the frame timeout.
    TIMEOUT = "timeout"
    #: Something failed here while reading or shaping the stream.
    LOCAL_ERROR = "local_error"
    #: The WSGI server closed the body before its end (client gone).
    DISCONNECT = "disconnect"
    #: The body was garbage-collected unread (e.g. a killed thread).
    GC = "gc"
    #: The request failed before a body took the lease.
    SETUP_FAILED = "setup_failed"

    @property
    def over_remotely(self) -> bool:
        """True when the broker has already finished the job: nothing to cancel."""
        return self in _OVER_REMOTELY

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


_OVER_REMOTELY = frozenset(
    {LeaseEnding.EOF, LeaseEnding.REMOTE_ERROR, LeaseEnding.REFUSED}
)


class SlotLease:
    """Released exactly once, by whichever ending comes first."""

    def __init__(
        self,
        job_id: str,
        send: Callable[[messages.Message], None],
        forget: Callable[[str], None],
        on_release: Callable[[SlotLease], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self._send = send
        self._forget = forget
        self._on_release = on_release
        self._lock = threading.Lock()
        self.ending: LeaseEnding | None = None
        self.taken_at = time.monotonic()
        self.released_at: float | None = None

    @property
    def released(self) -> bool:
        return self.ending is not None

    def release(self, ending: LeaseEnding) -> bool:
        """End the lease. Returns True only for the call that released it."""
        if not isinstance(ending, LeaseEnding):
            # A bare string is how local failures once passed for remote ones.
            raise TypeError(f"a lease ends with a LeaseEnding, not {ending!r}")
        with self._lock:
            if self.ending is not None:
                return False
            self.ending = ending
            self.released_at = time.monotonic()
        try:
            if not ending.over_remotely:
                self._send(messages.Cancel(self.job_id))
        finally:
            self._forget(self.job_id)
            if self._on_release is not None:
                self._on_release(self)
        return True
