"""ZeroMQ CURVE: key files and socket configuration for encrypted links.

Between hosts every link is CURVE-encrypted and authenticated. The broker is
the CURVE *server* (it holds its secret key; clients must know its public
key); workers and frontends are *clients* with their own key pairs, whose
public keys the broker lists in one authorized directory per role: a key
listed for workers is accepted only on the workers socket, a key listed for
frontends only on the frontends socket (see ``workers.broker.security``).

Key files are ZeroMQ certificates as written by ``zmq.auth.create_certificates``
(``llamapool keygen``): ``NAME.key`` holds the public key, ``NAME.key_secret``
both keys.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import threading
import uuid
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("llamapool.curve")

#: The two roles a client key can have, one per broker socket.
WORKERS = "workers"
FRONTENDS = "frontends"
#: The ZAP domain of each broker socket. The ZAP request carries it, so one
#: handler checks a key against the right role's allow-list.
ZAP_DOMAINS = {WORKERS: "llamapool-workers", FRONTENDS: "llamapool-frontends"}


class CurveKeyError(ValueError):
    """A key file is missing, unreadable or not a CURVE certificate."""


def available() -> bool:
    """Whether this libzmq was built with CURVE (libsodium)."""
    return bool(zmq.has("curve"))


def load_public_key(path: str | os.PathLike) -> bytes:
    """The public key (z85) from a ``.key`` or ``.key_secret`` file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key {path}: {exc}") from None
    if not public:
        raise CurveKeyError(f"no public key in {path}")
    return public


def load_key_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key {path}: {exc}") from None
    if not public or not secret:
        raise CurveKeyError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    """The broker's key pair."""

    public: bytes
    secret: bytes

    @classmethod
    def from_file(cls, secret_file: str | os.PathLike) -> ServerKeys:
        return cls(*load_key_pair(secret_file))

    def apply(self, sock: zmq.Socket, zap_domain: str) -> None:
        """Make ``sock`` a CURVE server (call before ``bind``).

        ``zap_domain`` (one of ``ZAP_DOMAINS``) says which role's keys the
        ZAP handler accepts on this socket.
        """
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())

    def __repr__(self) -> str:  # never print a secret key
        return f"ServerKeys(public={self.public.decode()!r})"


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """A worker's or frontend's key pair and the broker's public key."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(
        cls, server_key_file: str | os.PathLike, secret_file: str | os.PathLike
    ) -> ClientKeys:
        return cls(load_public_key(server_key_file), *load_key_pair(secret_file))

    def apply(self, sock: zmq.Socket, watch: bool = True) -> None:
        """Make ``sock`` a CURVE client of the broker (call before ``connect``).

        With ``watch``, a refused handshake is logged (see ``watch_handshakes``).
        """
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        if watch:
            try:
                watch_handshakes(sock, self.public)
            except zmq.ZMQError as exc:
                # Watching is only a diagnosis; the link must connect anyway.
                log.warning("cannot watch CURVE handshakes on a new "
                            "connection (%s); refusals will not be logged", exc)

    def __repr__(self) -> str:
        return (f"ClientKeys(server_public={self.server_public.decode()!r}, "
                f"public={self.public.decode()!r})")


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_MONITOR_STOPPED
)


def watch_handshakes(sock: zmq.Socket, public: bytes) -> threading.Thread:
    """Log, from a side thread, when the broker refuses this socket's handshake.

    Without this a refused peer is silent: libzmq drops a connection whose
    ZAP check failed and never retries it, so the peer just hears nothing.
    The thread ends when ``sock`` is closed.
    """
    # A unique address: pyzmq's default is derived from the socket's file
    # descriptor, which a new DEALER may reuse while the monitor of the one it
    # replaces is still closing ("Address already in use" ended a worker's
    # link thread on a redial).
    monitor = sock.get_monitor_socket(
        _HANDSHAKE_EVENTS, addr=f"inproc://llamapool-curve-monitor-{uuid.uuid4().hex}")
    key = public.decode()

    def loop() -> None:
        failures = 0
        try:
            while True:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                failures += 1
                if failures > 3 and failures % 100:
                    continue  # a wrong server key retries every 100 ms
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    log.error(
                        "the broker refused this peer's CURVE public key %s: add "
                        "its .key file to the broker's authorized directory for "
                        "this role (--curve-authorized-workers for a worker, "
                        "--curve-authorized-frontends for a frontend)", key
                    )
                else:
                    log.error(
                        "CURVE handshake with the broker failed (#%d): is the "
                        "broker's public key (--curve-server-key) right, and "
                        "does the broker run with CURVE?", failures
                    )
        except zmq.ZMQError:
            return  # the context is being terminated
        finally:
            monitor.close(linger=0)

    thread = threading.Thread(target=loop, name="curve-handshakes", daemon=True)
    thread.start()
    return thread


def client_keys(server_key_file: str, secret_file: str) -> ClientKeys | None:
    """Keys from the two file settings; None when both are empty (plaintext).

    Raises:
        CurveKeyError: only one of the two is set, or a file is bad.
    """
    if not server_key_file and not secret_file:
        return None
    if not server_key_file or not secret_file:
        raise CurveKeyError(
            "CURVE needs both the broker's public key and this peer's secret key"
        )
    return ClientKeys.from_files(server_key_file, secret_file)


def is_local_endpoint(endpoint: str) -> bool:
    """True if ``endpoint`` can only be reached from this host.

    ``ipc://`` and ``inproc://`` are local; ``tcp://`` is local only on a
    loopback address or ``localhost``. Wildcards (``*``, ``0.0.0.0``) and
    interface names are not.
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    # tcp://[source;]host:port; a source address only picks the local side.
    host = urlsplit("//" + rest.rsplit(";", 1)[-1]).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
