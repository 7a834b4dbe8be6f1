"""CURVE on the command line: the flags, and ``llamapool keygen``.

The key-path flags themselves are settings of each process (see
``llamapool.cli``), so systemd environment files can carry them as
``LLAMAPOOL_CURVE_*`` variables.

``llamapool keygen DIR`` writes::

    DIR/broker.key          DIR/broker.key_secret      (broker host only)
    DIR/worker.key          DIR/worker.key_secret      (worker hosts)
    DIR/frontend.key        DIR/frontend.key_secret    (frontend hosts)
    DIR/authorized/worker.key, DIR/authorized/frontend.key
                                                     (the broker's allow-list)

Secret files are 0600, public ones 0644. ``--client NAME`` (repeatable) names
the client key pairs instead, e.g. one per host so a single host can be
revoked. Existing key pairs are kept, never overwritten: running it again
with a new ``--client`` adds that pair and leaves the broker's key alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

from zmq.auth import create_certificates

from llamapool.exit_codes import ExitCode
from protocol import curve

BROKER_NAME = "broker"
DEFAULT_CLIENTS = ("worker", "frontend")
AUTHORIZED_SUBDIR = "authorized"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def add_keygen_parser(sub) -> None:
    keygen = sub.add_parser("keygen", help="write CURVE key pairs for a deployment")
    keygen.add_argument("dir", help="output directory (created if missing)")
    keygen.add_argument("--client", action="append", default=[],
                        help="client key pair name (repeatable; default: "
                             "worker and frontend)")


def _write_pair(directory: Path, name: str) -> tuple[Path, Path, bool]:
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if secret.exists():
        curve.load_key_pair(secret)  # an existing pair must at least be valid
        return public, secret, False
    # Create under a tight umask: the secret must never exist world-readable,
    # not even between the write and a chmod.
    old = os.umask(0o077)
    try:
        create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret, True


def write_keys(
    directory: str | os.PathLike, clients: list[str] | None = None
) -> list[str]:
    """Create the broker's and the clients' key pairs; report lines for humans.

    Raises:
        ValueError: a client name is not a plain file name, or is "broker".
    """
    out = Path(directory)
    authorized = out / AUTHORIZED_SUBDIR
    authorized.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o755)
    os.chmod(authorized, 0o755)
    clients = list(clients or DEFAULT_CLIENTS)
    for name in clients:
        if name == BROKER_NAME or not _NAME.match(name):
            raise ValueError(f"bad client key name {name!r}")
    report = []
    for name in [BROKER_NAME, *clients]:
        public, secret, created = _write_pair(out, name)
        report.append(f"{'wrote' if created else 'kept '} {secret} (+ {public.name})")
        if name != BROKER_NAME:
            listed = authorized / public.name
            shutil.copyfile(public, listed)
            os.chmod(listed, 0o644)
    report.append(f"authorized public keys: {authorized}")
    return report


def run_keygen(args: argparse.Namespace) -> int:
    """``llamapool keygen``; returns the exit code."""
    try:
        report = write_keys(args.dir, args.client)
    except (ValueError, OSError) as exc:
        print(f"llamapool keygen: {exc}")
        return ExitCode.USAGE
    for line in report:
        print(line)
    return ExitCode.OK
