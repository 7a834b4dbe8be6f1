"""What a service (broker, model worker) needs from the process running it.

The services take these as arguments rather than importing the command's
plumbing (``llamapool.signals``, ``llamapool.sd_notify``), so imports run one
way: ``protocol <- workers <- frontend <- llamapool``.
"""

from __future__ import annotations

from typing import Protocol


class StopSignal(Protocol):
    """Set when the process should stop (``llamapool.signals.StopFlag``)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout_s: float | None) -> bool: ...


class ServiceNotifier(Protocol):
    """Lifecycle reports to a supervisor (``llamapool.sd_notify.Notifier``)."""

    def ready(self, status: str = "") -> None: ...

    def watchdog(self, now: float | None = None) -> None: ...

    def stopping(self, status: str = "") -> None: ...


class SilentNotifier:
    """A ``ServiceNotifier`` for processes nobody supervises (tests, tools)."""

    def ready(self, status: str = "") -> None:
        pass

    def watchdog(self, now: float | None = None) -> None:
        pass

    def stopping(self, status: str = "") -> None:
        pass
