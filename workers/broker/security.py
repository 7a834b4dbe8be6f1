"""The broker's side of CURVE: its keys, the ZAP allow-lists, the bind policy.

With CURVE on, both ROUTER sockets are CURVE servers and one ZAP handler
(``zmq.auth.thread.ThreadAuthenticator``) checks every handshake. Keys have
roles: each socket sets its own ZAP domain (``protocol.curve.ZAP_DOMAINS``),
and the handler checks the client's public key against that role's
directory only. A key listed for frontends is refused on the workers socket
(it cannot register as a worker and read other users' prompts), and a key
listed for workers is refused on the frontends socket (it cannot SUBMIT).
A refused peer never completes the handshake, so the broker never sees a
frame from it. Each refusal is counted (``curve_refused`` and
``curve_refused_<role>`` in the broker's counters).

Each directory is re-read when anything in it changes, so adding, removing
or overwriting a host's key needs no broker restart (``KeyDirectory``). ZAP
runs only at the handshake, so a revoked key would keep the connections it
already opened; the broker therefore also re-reads the directories once per
heartbeat and checks every message's ``User-Id`` (the client key ZAP
accepted) against them: messages from a revoked key are dropped and its
peer leaves the ledger (``Broker._recv_authorized``). Unanswered, that peer redials
after its silence window, and the new handshake is refused.

Bind policy: without CURVE the broker binds only local endpoints (loopback
TCP, ``ipc://``) unless the operator passed ``--insecure-plaintext``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol import curve

log = logging.getLogger("llamapool.broker")

#: A listing taken less than this long after a key file changed is not
#: trusted: a second write within the file system's timestamp granularity
#: (up to 2 s on some) could leave size and times unchanged. It is read
#: again at the next handshake, as git does with "racily clean" files.
RACY_WINDOW_NS = 2_000_000_000

#: The flag naming each role's directory, for messages to the operator.
ROLE_FLAGS = {
    curve.WORKERS: "--curve-authorized-workers",
    curve.FRONTENDS: "--curve-authorized-frontends",
}


class InsecureEndpoint(Exception):
    """A non-local endpoint would be bound without CURVE."""


def _fingerprint(directory: str) -> tuple:
    """What changes when a ``*.key`` in ``directory`` is added, removed or rewritten.

    The ctime is in it because an in-place overwrite need not change the
    directory's mtime, the file's size (z85 keys all have one length) or
    even its mtime (``cp -p``, ``rsync -t`` and ``touch`` set that back);
    the ctime cannot be set back.

    Raises:
        OSError: the directory cannot be listed.
    """
    entries = []
    with os.scandir(directory) as it:
        for entry in it:
            if not entry.name.endswith(".key"):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed while we listed; the next look sees it gone
            entries.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns,
                            st.st_ctime_ns))
    st = os.stat(directory)
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, tuple(sorted(entries)))


def _newest_change_ns(fingerprint: tuple) -> int:
    _, dir_mtime, dir_ctime, entries = fingerprint
    return max([dir_mtime, dir_ctime, *(max(e[3], e[4]) for e in entries)])


class KeyDirectory:
    """The public keys of one role: the ``*.key`` files in one directory.

    ``reload()`` re-reads the directory when its fingerprint changed, or
    when the last read was too close to a change to be trusted. The ZAP
    thread calls it at each handshake and the broker's loop once per
    heartbeat, hence the lock.
    """

    def __init__(self, role: str, directory: str) -> None:
        self.role = role
        self.directory = directory
        self._fingerprint: tuple | None = None
        self._trusted = False
        self._loaded = False
        self._keys: frozenset[bytes] = frozenset()
        self._lock = threading.Lock()
        self.reload()

    @property
    def current(self) -> frozenset[bytes]:
        """The keys as last read (no look at the directory)."""
        return self._keys

    def reload(self) -> frozenset[bytes]:
        """The current keys, read again if anything changed.

        Raises:
            CurveKeyError: the directory or a key in it cannot be read.
        """
        with self._lock:
            return self._reload()

    def _reload(self) -> frozenset[bytes]:
        try:
            before = _fingerprint(self.directory)
            if self._trusted and before == self._fingerprint:
                return self._keys
            read_at_ns = time.time_ns()
            keys = frozenset(zmq.auth.load_certificates(self.directory))
            after = _fingerprint(self.directory)
        except (OSError, ValueError) as exc:
            raise curve.CurveKeyError(
                f"authorized {self.role} key directory {self.directory}: {exc}"
            ) from None
        changed = keys != self._keys or not self._loaded
        self._keys, self._loaded = keys, True
        # Changed while we read: keep the old fingerprint so we read again.
        self._fingerprint = after if after == before else None
        self._trusted = (self._fingerprint is not None
                         and read_at_ns - _newest_change_ns(after) > RACY_WINDOW_NS)
        if changed:
            log.info("CURVE: %d authorized %s keys in %s", len(keys), self.role,
                     self.directory)
        return keys


class AllowList:
    """The ZAP credentials provider for one role (one socket's ZAP domain).

    ZAP calls ``callback`` from the authenticator's thread, once per
    handshake (connections are long-lived, so this is rare).
    """

    def __init__(self, keys: KeyDirectory,
                 on_refused: Callable[[str], None]) -> None:
        self.keys = keys
        self.role = keys.role
        self._on_refused = on_refused
        self.refused = 0
        if not keys.reload():
            log.warning("no public keys in %s: every %s will be refused",
                        keys.directory, self.role.rstrip("s"))

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP credentials callback: is this z85 key authorized for this role?"""
        try:
            listed = self.keys.reload()
        except curve.CurveKeyError as exc:
            log.error("%s; keeping the previous key list", exc)
            listed = self.keys.current
        if client_key in listed:
            return True
        self.refused += 1
        self._on_refused(self.role)
        # Rate-limited: a peer retrying every 100 ms must not flood the log.
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning(
                "CURVE: refused public key %s on the %s socket: not in %s "
                "(refusal #%d)", client_key.decode(errors="replace"), self.role,
                self.keys.directory, self.refused,
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
        authorized_workers: str = "",
        authorized_frontends: str = "",
        insecure_plaintext: bool = False,
        on_refused: Callable[[str], None] = lambda role: None,
    ) -> None:
        self.secret_key_file = secret_key_file
        self.authorized = {curve.WORKERS: authorized_workers,
                           curve.FRONTENDS: authorized_frontends}
        self.insecure_plaintext = insecure_plaintext
        self._on_refused = on_refused
        self._keys: curve.ServerKeys | None = None
        self.allow_lists: dict[str, AllowList] = {}
        self._auth: ThreadAuthenticator | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.secret_key_file or any(self.authorized.values()))

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
                "--curve-secret-key, --curve-authorized-workers and "
                "--curve-authorized-frontends (see `llamapool keygen`), or "
                "--insecure-plaintext"
            )
        log.warning(
            "INSECURE: binding %s in plaintext; any host that reaches it can "
            "register workers and read every prompt and completion",
            ", ".join(exposed),
        )

    def _check_directories(self) -> None:
        missing = [flag for role, flag in ROLE_FLAGS.items()
                   if not self.authorized[role]]
        if not self.secret_key_file or missing:
            raise curve.CurveKeyError(
                "CURVE needs --curve-secret-key, --curve-authorized-workers and "
                "--curve-authorized-frontends" + (
                    f" (missing: {', '.join(missing)})" if missing else "")
            )
        workers, frontends = (os.path.realpath(self.authorized[r])
                              for r in (curve.WORKERS, curve.FRONTENDS))
        if workers == frontends:
            # One directory would authorise every key for both roles: exactly
            # what the roles exist to prevent.
            raise curve.CurveKeyError(
                f"--curve-authorized-workers and --curve-authorized-frontends "
                f"are the same directory ({workers}); give each role its own "
                "(`llamapool keygen` lays out authorized/workers and "
                "authorized/frontends)"
            )

    def start(self, ctx: zmq.Context) -> None:
        """Load the keys and start the ZAP handler (before any socket binds).

        Raises:
            CurveKeyError: a key file or a directory is missing or bad, a
                setting is missing, or both roles share one directory.
        """
        if not self.enabled or self._auth is not None:
            return
        self._check_directories()
        if not curve.available():
            raise curve.CurveKeyError("this libzmq has no CURVE support")
        self._keys = curve.ServerKeys.from_file(self.secret_key_file)
        self.allow_lists = {
            role: AllowList(KeyDirectory(role, directory), self._on_refused)
            for role, directory in self.authorized.items()
        }
        both = (self.allow_lists[curve.WORKERS].keys.reload()
                & self.allow_lists[curve.FRONTENDS].keys.reload())
        for key in sorted(both):
            log.warning("CURVE: public key %s is authorized as a worker AND as a "
                        "frontend; give each host its own key per role",
                        key.decode(errors="replace"))
        self._auth = ThreadAuthenticator(ctx, log=log.getChild("zap"))
        self._auth.start()
        for role, allow_list in self.allow_lists.items():
            self._auth.configure_curve_callback(
                domain=curve.ZAP_DOMAINS[role], credentials_provider=allow_list)
        log.info("CURVE on: broker public key %s", self._keys.public.decode())

    def current_keys(self) -> dict[str, frozenset[bytes]] | None:
        """Each role's keys as the directories hold them now; None in plaintext.

        The broker's loop calls this once per heartbeat, to drop messages
        from connections whose key was revoked after their handshake. A
        directory that cannot be read keeps its previous keys (logged).
        """
        if not self.allow_lists:
            return None
        keys = {}
        for role, allow_list in self.allow_lists.items():
            try:
                keys[role] = allow_list.keys.reload()
            except curve.CurveKeyError as exc:
                log.error("%s; keeping the previous key list", exc)
                keys[role] = allow_list.keys.current
        return keys

    def configure(self, sock: zmq.Socket, role: str) -> None:
        """Make the ``role`` socket a CURVE server (no-op in plaintext)."""
        if self._keys is not None:
            self._keys.apply(sock, curve.ZAP_DOMAINS[role])

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
