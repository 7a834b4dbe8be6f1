"""Stop strings that never leak into the output, even split across tokens."""

from __future__ import annotations


class StopStringFilter:
    """Holds back text that might be the start of a stop string.

    Feed each new piece of decoded text to ``push``; it returns the text that
    is safe to emit now. Once a stop string is seen, ``stopped`` is True and
    nothing after it (nor the stop string itself) is ever returned.
    ``flush`` returns what was held back when generation ends for another
    reason.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._pending = ""
        self.stopped = False
        #: The stop string that ended the output ("" until one did): llama.cpp's
        #: native ``stopping_word``.
        self.matched = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        cut = self._first_stop_index()
        if cut is not None:
            self.stopped = True
            self.matched = min((s for s in self.stops if s in self._pending),
                               key=self._pending.find)
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._partial_suffix_len()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _first_stop_index(self) -> int | None:
        found = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _partial_suffix_len(self) -> int:
        """Length of the longest tail of pending that starts some stop string."""
        pending = self._pending
        for size in range(min(len(pending), self._longest - 1), 0, -1):
            tail = pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
