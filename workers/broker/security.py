"""The broker's side of CURVE: its keys, the ZAP allow-list, the bind policy.

With CURVE on, both ROUTER sockets are CURVE servers and a ZAP handler
(``zmq.auth.thread.ThreadAuthenticator``) accepts a client only if its public
key is in the authorized directory. A refused peer never completes the
handshake, so the broker never sees a frame from it: no slot, no job, no
reply. Each refusal is counted (``curve_refused`` in the broker's counters).

The authorized directory is re-read when it changes (its mtime), so adding
or removing a host's key needs no broker restart; a removed key stops new
connections, not ones already open.

Bind policy: without CURVE the broker binds only local endpoints (loopback
TCP, ``ipc://``) unless the operator passed ``--insecure-plaintext``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol import curve

log = logging.getLogger("llamapool.broker")


class InsecureEndpoint(Exception):
    """A non-local endpoint would be bound without CURVE."""


class AllowList:
    """Public keys of the peers the broker accepts, from a directory of ``*.key``.

    ZAP calls ``callback`` from the authenticator's thread, once per
    handshake (connections are long-lived, so this is rare).
    """

    def __init__(self, directory: str, on_refused: Callable[[], None]) -> None:
        self.directory = directory
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._mtime_ns = -1
        self._keys: frozenset[bytes] = frozenset()
        self.refused = 0
        self.reload()
        if not self._keys:
            log.warning("no public keys in %s: every peer will be refused", directory)

    def reload(self) -> None:
        """Re-read the directory if it changed since the last read."""
        try:
            mtime_ns = os.stat(self.directory).st_mtime_ns
        except OSError as exc:
            raise curve.CurveKeyError(
                f"authorized key directory {self.directory}: {exc}"
            ) from None
        with self._lock:
            if mtime_ns == self._mtime_ns:
                return
            try:
                keys = zmq.auth.load_certificates(self.directory)
            except (OSError, ValueError) as exc:
                raise curve.CurveKeyError(
                    f"authorized key directory {self.directory}: {exc}"
                ) from None
            self._keys = frozenset(keys)
            self._mtime_ns = mtime_ns
        log.info("CURVE: %d authorized public keys in %s", len(keys), self.directory)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP credentials callback: is this z85 public key authorized?"""
        try:
            self.reload()
        except curve.CurveKeyError as exc:
            log.error("%s; keeping the previous key list", exc)
        if client_key in self._keys:
            return True
        self.refused += 1
        self._on_refused()
        # Rate-limited: a peer retrying every 100 ms must not flood the log.
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning(
                "CURVE: refused unlisted public key %s (refusal #%d)",
                client_key.decode(errors="replace"), self.refused,
            )
        return False


class BrokerSecurity:
    """Holds the broker's CURVE state; inert (plaintext) when not configured.

    Nothing is read until ``start``, so a bad key file surfaces at bind time,
    where the CLI maps it to a named exit code.
    """

    def __init__(
        self,
        secret_key_file: str = "",
        authorized_dir: str = "",
        insecure_plaintext: bool = False,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.secret_key_file = secret_key_file
        self.authorized_dir = authorized_dir
        self.insecure_plaintext = insecure_plaintext
        self._on_refused = on_refused
        self._keys: curve.ServerKeys | None = None
        self.allow_list: AllowList | None = None
        self._auth: ThreadAuthenticator | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.secret_key_file or self.authorized_dir)

    def check_endpoints(self, endpoints: Iterable[str]) -> None:
        """Enforce the bind policy.

        Raises:
            InsecureEndpoint: a non-local endpoint without CURVE and without
                the explicit opt-out.
        """
        if self.enabled:
            return
        exposed = [ep for ep in endpoints if not curve.is_local_endpoint(ep)]
        if not exposed:
            return
        if not self.insecure_plaintext:
            raise InsecureEndpoint(
                f"refusing to bind {', '.join(exposed)} without CURVE: pass "
                "--curve-secret-key and --curve-authorized-dir (see "
                "`llamapool keygen`), or --insecure-plaintext"
            )
        log.warning(
            "INSECURE: binding %s in plaintext; any host that reaches it can "
            "register workers and read every prompt and completion",
            ", ".join(exposed),
        )

    def start(self, ctx: zmq.Context) -> None:
        """Load the keys and start the ZAP handler (before any socket binds).

        Raises:
            CurveKeyError: a key file or the directory is missing or bad, or
                only one of the two is configured.
        """
        if not self.enabled or self._auth is not None:
            return
        if not (self.secret_key_file and self.authorized_dir):
            raise curve.CurveKeyError(
                "CURVE needs both --curve-secret-key and --curve-authorized-dir"
            )
        if not curve.available():
            raise curve.CurveKeyError("this libzmq has no CURVE support")
        self._keys = curve.ServerKeys.from_file(self.secret_key_file)
        self.allow_list = AllowList(self.authorized_dir, self._on_refused)
        self._auth = ThreadAuthenticator(ctx, log=log.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve_callback(
            domain=curve.ZAP_DOMAIN, credentials_provider=self.allow_list
        )
        log.info("CURVE on: broker public key %s", self._keys.public.decode())

    def configure(self, sock: zmq.Socket) -> None:
        """Make a broker socket a CURVE server (no-op in plaintext)."""
        if self._keys is not None:
            self._keys.apply(sock)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
