"""systemd's service notification protocol, without libsystemd.

A ``Type=notify`` unit gets ``$NOTIFY_SOCKET``: an ``AF_UNIX`` datagram socket
(a path, or ``@name`` in the abstract namespace). A service tells systemd it
is up with ``READY=1``, proves it is alive with ``WATCHDOG=1`` at least every
``$WATCHDOG_USEC`` microseconds, and announces a shutdown with ``STOPPING=1``.
Outside systemd the variable is unset and every call here is a no-op.

Each process sends from the loop whose liveness matters (the broker's loop,
the worker's I/O thread, the gunicorn arbiter's workers), so a wedged loop
stops the pings and systemd restarts the service.

See sd_notify(3) and systemd.service(5), ``WatchdogSec=``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("llamapool.sd_notify")


def notify_address(env: Mapping[str, str] | None = None) -> str | bytes | None:
    """The socket address from ``$NOTIFY_SOCKET``, or None when not under systemd.

    An address starting with ``@`` is in the abstract namespace (a leading NUL
    byte on the wire). Other schemes (``vsock:``) are not supported here.
    """
    env = os.environ if env is None else env
    raw = env.get("NOTIFY_SOCKET", "")
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """How often to send ``WATCHDOG=1`` (half of ``$WATCHDOG_USEC``), or None.

    ``$WATCHDOG_PID``, when set, names the one process the watchdog is for; a
    child that inherited the variables must not ping for its parent.
    """
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


class Notifier:
    """Sends notifications to systemd; silent and cheap when not under it."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.address = notify_address(env)
        self.watchdog_interval_s = watchdog_interval_s(env)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._ready_sent = False
        self._stopping_sent = False
        self._next_watchdog = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines in one datagram. False if it did not go out."""
        if self.address is None:
            return False
        payload = "\n".join(assignments).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                self._sock.sendto(payload, self.address)
                return True
            except OSError as exc:
                # systemd going away must never take the service down with it.
                log.debug("sd_notify %r failed: %s", assignments, exc)
                return False

    def ready(self, status: str = "") -> None:
        """``READY=1`` once per process, with an optional ``STATUS=`` line."""
        if self._ready_sent:
            return
        self._ready_sent = True
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self, now: float | None = None) -> None:
        """``WATCHDOG=1``, at most every quarter of the watchdog period."""
        if self.watchdog_interval_s is None or self.address is None:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_watchdog:
            return
        # A quarter period leaves room for a late loop iteration or two.
        self._next_watchdog = now + self.watchdog_interval_s / 2
        self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> None:
        """``STOPPING=1`` once per process."""
        if self._stopping_sent:
            return
        self._stopping_sent = True
        self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def start_watchdog_thread(
        self, healthy: Callable[[], bool]
    ) -> threading.Thread | None:
        """Ping from a daemon thread while ``healthy()`` holds.

        For processes whose main loop offers no hook (gunicorn's arbiter):
        ``healthy`` must check the thing that can wedge, or the ping proves
        nothing.
        """
        if self.watchdog_interval_s is None or self.address is None:
            return None
        interval_s = self.watchdog_interval_s / 2

        def loop() -> None:
            while True:
                try:
                    ok = healthy()
                except Exception:  # a broken probe means unhealthy, not a crash
                    ok = False
                if ok:
                    self.notify("WATCHDOG=1")
                time.sleep(interval_s)  # a timer, not synchronisation

        thread = threading.Thread(target=loop, name="sd-watchdog", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
