"""The slot lease: the frontend's claim on one job's slot (DESIGN.md, seed 000).

The responder takes the lease when it submits. If setup fails, the responder
releases it. Once the stream is accepted, the lease moves into the response
body and ends with it: at EOF, on a terminal error, or when the body is closed
or garbage-collected unread (client disconnect). These are endings of one
resource, so ``release`` is idempotent: whichever path comes first releases,
the rest find nothing to do.

Releasing the lease does not free the remote slot by itself. Unless the job
already ended (EOF, error, refused), release sends CANCEL; the broker frees the
slot when the worker acknowledges with its terminal frame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from protocol import messages

#: Endings where the job is already over at the broker: nothing to cancel.
ENDED_REMOTELY = frozenset({"eof", "error", "refused"})


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
        self.ending: str | None = None
        self.taken_at = time.monotonic()
        self.released_at: float | None = None

    @property
    def released(self) -> bool:
        return self.ending is not None

    def release(self, ending: str) -> bool:
        """End the lease. Returns True only for the call that released it."""
        with self._lock:
            if self.ending is not None:
                return False
            self.ending = ending
            self.released_at = time.monotonic()
        try:
            if ending not in ENDED_REMOTELY:
                self._send(messages.Cancel(self.job_id))
        finally:
            self._forget(self.job_id)
            if self._on_release is not None:
                self._on_release(self)
        return True
