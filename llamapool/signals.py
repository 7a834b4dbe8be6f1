"""Signals only set a flag; the main loop acts on it (gunicorn's arbiter).

The first SIGTERM or SIGINT asks for a graceful stop. A second one exits at
once, for an operator who does not want to wait for the grace period.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal

from llamapool.exit_codes import ExitCode

#: Exit code used when a second signal forces an immediate exit.
EXIT_FORCED = ExitCode.FORCED


class StopFlag:
    """Set by SIGTERM/SIGINT. ``wait``-able, so loops can sleep on it.

    The handler takes no lock. It runs on the main thread, between two
    bytecodes of whatever that thread was doing, and with a
    ``threading.Event`` that could be inside ``Event.wait`` holding the lock
    ``Event.set`` needs: the handler then blocked forever (``llamapool up``
    hung on SIGTERM; ``tests/test_stop_flag.py``). So a set is a plain
    boolean plus one byte in a pipe that is never drained; ``wait`` is a
    ``select`` on that pipe, which any number of threads may do at once,
    and which Python retries with the time left when a signal interrupts it.
    """

    def __init__(self) -> None:
        self._set = False
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.signal_count = 0

    def install(self) -> StopFlag:
        """Install handlers for SIGTERM and SIGINT (main thread only)."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_count += 1
        if self.signal_count > 1:
            os._exit(EXIT_FORCED)
        self.set()

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full of earlier sets: already readable

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float | None) -> bool:
        if not self._set:
            # Readable for good once set (never drained).
            select.select([self._read_fd], [], [], timeout_s)
        return self._set


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack to stderr (the
    log), and the process goes on: for a broker or worker that seems stuck.
    (Not for the frontend: gunicorn's arbiter uses SIGUSR1 to reopen logs.)"""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
