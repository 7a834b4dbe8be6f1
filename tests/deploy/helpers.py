"""Helpers for the deployment tests: systemd's notify socket, CURVE probes.

Everything here talks to real processes over real sockets; waiting is done
by polling a condition with a deadline.
"""

from __future__ import annotations

import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.pool import BrokerProbe


class NotifyListener:
    """An ``AF_UNIX`` datagram socket standing in for systemd's notify socket.

    Every datagram is kept with its arrival time (monotonic) and the sender's
    pid (``SCM_CREDENTIALS``, as systemd reads it: with the default
    ``NotifyAccess=main`` only the main process may notify).
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.received: list[tuple[float, str]] = []
        self.senders: list[int] = []

    def env(self, watchdog_usec: int | None = None) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.path}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def _pump(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout_s))
        while readable:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            self.received.append((time.monotonic(), data.decode()))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    self.senders.append(struct.unpack("iII", payload[:12])[0])
            readable, _, _ = select.select([self.sock], [], [], 0)

    def times(self, line: str) -> list[float]:
        """Arrival times of datagrams containing ``line`` (e.g. ``READY=1``)."""
        return [t for t, text in self.received if line in text.split("\n")]

    def wait_for(self, line: str, timeout_s: float, count: int = 1) -> list[float]:
        """Wait until ``count`` datagrams with ``line`` arrived; their times."""
        deadline = time.monotonic() + timeout_s
        while len(self.times(line)) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"timed out after {timeout_s}s waiting for {count} x {line}; "
                    f"got {[text for _, text in self.received]}"
                )
            self._pump(remaining)
        return self.times(line)

    def absent_for(self, line: str, window_s: float) -> bool:
        """True if no datagram with ``line`` arrives within ``window_s``."""
        deadline = time.monotonic() + window_s
        while (remaining := deadline - time.monotonic()) > 0:
            self._pump(remaining)
            if self.times(line):
                return False
        return not self.times(line)

    def close(self) -> None:
        self.sock.close()


def keygen(directory: Path, *args: str) -> Path:
    """Run the real ``llamapool keygen`` (``args``: e.g. ``--worker w1``)."""
    subprocess.run(
        [sys.executable, "-m", "llamapool", "keygen", str(directory), *args],
        check=True, capture_output=True,
    )
    return directory


#: A BrokerProbe that speaks CURVE (pass the client keys).
CurveProbe = BrokerProbe

