"""Repeated log lines, rate-limited: a flood of peers must not flood the log.

A fake worker that registers and vanishes 2 000 times wrote 147 MB of
"worker registered" and "worker lost" lines. ``LogThrottle`` lets each kind
of line (its key) through ``burst`` times per ``window_s``; the rest of the
window is counted, and the next line that gets through says how many were
held back, so nothing is lost from the record but the repetition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class LogThrottle:
    """Per-key log rate limit: ``burst`` lines per ``window_s`` seconds.

    Keys are the caller's fixed names for kinds of line ("worker lost"),
    never peer data, so the table stays as small as the code that uses it.
    """

    def __init__(self, logger: logging.Logger, burst: int = 10,
                 window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        #: key -> [window start, lines let through in it, lines held back]
        self._state: dict[str, list] = {}

    def log(self, level: int, key: str, msg: str, *args) -> bool:
        """Log ``msg % args`` unless ``key`` used up its burst; True if logged."""
        now = self._clock()
        state = self._state.get(key)
        if state is None or now - state[0] >= self._window_s:
            held = state[2] if state is not None else 0
            state = self._state[key] = [now, 0, held]
        if state[1] >= self._burst:
            state[2] += 1
            return False
        state[1] += 1
        if state[2]:
            msg += " (%d similar lines held back)"
            args = (*args, state[2])
            state[2] = 0
        self._log.log(level, msg, *args)
        return True

    def info(self, key: str, msg: str, *args) -> bool:
        return self.log(logging.INFO, key, msg, *args)

    def warning(self, key: str, msg: str, *args) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
