"""Signals only set a flag; the main loop acts on it (gunicorn's arbiter).

The first SIGTERM or SIGINT asks for a graceful stop. A second one exits at
once, for an operator who does not want to wait for the grace period.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

from llamapool.exit_codes import ExitCode

#: Exit code used when a second signal forces an immediate exit.
EXIT_FORCED = ExitCode.FORCED


class StopFlag:
    """Set by SIGTERM/SIGINT. ``wait``-able, so loops can sleep on it."""

    def __init__(self) -> None:
        self._event = threading.Event()
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
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None) -> bool:
        return self._event.wait(timeout_s)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack to stderr (the
    log), and the process goes on: for a broker or worker that seems stuck.
    (Not for the frontend: gunicorn's arbiter uses SIGUSR1 to reopen logs.)"""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
