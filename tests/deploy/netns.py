"""A small LAN of Linux network namespaces for multi-host tests.

Each host is a network namespace with one veth interface (``eth0``) whose
peer is a port on a bridge that lives in a separate "switch" namespace, so
the test touches nothing in the machine's own network. Cutting a host sets
its switch port down: the host keeps its address and its sockets, but no
packet crosses (a pulled cable, as seen from the rest of the LAN).

Processes run on a host through ``ip netns exec``, each in its own UTS
namespace with the host's name as hostname (so the broker's ledger shows
which host a worker is on). Test code itself reaches a host's network from
threads that ``setns()`` into a namespace (``NetnsExecutor``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import secrets
import subprocess
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def enter_netns(name: str) -> None:
    """Move the calling thread (only) into network namespace ``name``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(_NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def namespaces_work() -> str | None:
    """None if namespaces, veth pairs and setns are allowed here, else why not."""
    probe = f"lpprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, FileNotFoundError) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        pool = concurrent.futures.ThreadPoolExecutor(1, initializer=enter_netns,
                                                     initargs=(probe,))
        pool.submit(lambda: None).result()
        pool.shutdown()
    except Exception as exc:
        return f"network namespaces are restricted here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Host:
    """One namespace on the LAN."""

    def __init__(self, lan: Lan, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self.netns = f"{lan.tag}-{name}"
        self.port = f"{lan.tag}{name}"[:15]  # the switch-side interface

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run on this host, with the host's name as hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *command]


class Lan:
    """Hosts on one bridge, 10.231.0.0/24, all in namespaces made here."""

    SUBNET = "10.231.0"

    def __init__(self) -> None:
        self.tag = f"lp{secrets.token_hex(2)}"  # unique per run, short for ifnames
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str, octet: int) -> Host:
        host = Host(self, name, f"{self.SUBNET}.{octet}")
        self._add_netns(host.netns)
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth",
            "peer", "name", "eth0", "netns", host.netns)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Pull the host's cable: its switch port goes down."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def close(self) -> None:
        """Delete every namespace (their interfaces go with them)."""
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._namespaces.clear()


class NetnsExecutor(concurrent.futures.ThreadPoolExecutor):
    """Threads that live in one host's network namespace.

    Sockets made in them (and ZeroMQ contexts, whose I/O threads inherit the
    namespace) are on that host's network for good.
    """

    def __init__(self, host: Host, max_workers: int = 8) -> None:
        super().__init__(max_workers, thread_name_prefix=f"netns-{host.name}",
                         initializer=enter_netns, initargs=(host.netns,))

    def call(self, fn, *args, **kwargs):
        """Run ``fn`` in the namespace and return its result."""
        return self.submit(fn, *args, **kwargs).result()
