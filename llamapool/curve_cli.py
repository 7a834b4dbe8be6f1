"""CURVE on the command line: the flags, and ``llamapool keygen``.

The key-path flags themselves are settings of each process (see
``llamapool.cli``), so systemd environment files can carry them as
``LLAMAPOOL_CURVE_*`` variables.

``llamapool keygen DIR`` writes::

    DIR/broker.key          DIR/broker.key_secret      (broker host only)
    DIR/worker.key          DIR/worker.key_secret      (worker hosts)
    DIR/frontend.key        DIR/frontend.key_secret    (frontend hosts)
    DIR/authorized/workers/worker.key                  (the broker's allow-list
    DIR/authorized/frontends/frontend.key               for each role)

Keys have roles: the broker accepts a key on its workers socket only if it is
in ``authorized/workers`` (``--curve-authorized-workers``), on its frontends
socket only if it is in ``authorized/frontends``. ``--worker NAME`` and
``--frontend NAME`` (repeatable) name the key pairs of each role instead of
the defaults, e.g. one per host so a single host can be revoked. A name has
one role: keygen refuses to list it in both.

Existing key pairs are kept, never overwritten: running it again with a new
``--worker`` adds that pair and leaves the broker's key alone. Directories
that keygen creates are 0700 (DIR holds secret keys); a directory that
already exists keeps its mode and owner. Secret files are 0600, public ones
0644.
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
DEFAULT_CLIENTS = {curve.WORKERS: ("worker",), curve.FRONTENDS: ("frontend",)}
AUTHORIZED_SUBDIR = "authorized"
#: Mode of the directories keygen creates; existing ones are left alone.
NEW_DIR_MODE = 0o700
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def add_keygen_parser(sub) -> None:
    keygen = sub.add_parser("keygen", help="write CURVE key pairs for a deployment")
    keygen.add_argument("dir", help="output directory (created 0700 if missing)")
    keygen.add_argument("--worker", action="append", default=[],
                        help="a worker key pair's name (repeatable; default: "
                             "worker); listed in authorized/workers")
    keygen.add_argument("--frontend", action="append", default=[],
                        help="a frontend key pair's name (repeatable; default: "
                             "frontend); listed in authorized/frontends")
    # Removed: a client key without a role. Kept only to say so.
    keygen.add_argument("--client", action="append", default=[],
                        help=argparse.SUPPRESS)


def ensure_dir(path: Path) -> bool:
    """Create ``path`` (and missing parents) with ``NEW_DIR_MODE``; True if new.

    A directory that exists is not touched: an operator's 0700 stays 0700.
    """
    missing = []
    for part in [path, *path.parents]:
        if part.exists():
            break
        missing.append(part)
    for part in reversed(missing):
        try:
            part.mkdir(mode=NEW_DIR_MODE)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, not ours
        os.chmod(part, NEW_DIR_MODE)  # mkdir's mode is narrowed by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    return bool(missing)


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


def _check_names(out: Path, clients: dict[str, list[str]]) -> None:
    """Each name is a plain file name with exactly one role, old or new."""
    for role, names in clients.items():
        other = curve.FRONTENDS if role == curve.WORKERS else curve.WORKERS
        for name in names:
            if name == BROKER_NAME or not _NAME.match(name):
                raise ValueError(f"bad key name {name!r}")
            if name in clients[other] or (
                    out / AUTHORIZED_SUBDIR / other / f"{name}.key").exists():
                raise ValueError(
                    f"{name!r} would be both a worker and a frontend key; a key "
                    "has one role (use a different name for each)")


def write_keys(directory: str | os.PathLike,
               clients: dict[str, list[str]] | None = None) -> list[str]:
    """Create the broker's and the clients' key pairs; report lines for humans.

    ``clients`` maps a role (``curve.WORKERS``, ``curve.FRONTENDS``) to key
    pair names; a role left out or empty gets no new pairs, and None means
    the defaults.

    Raises:
        ValueError: a name is not a plain file name, is "broker", or would
            have both roles.
    """
    out = Path(directory)
    if clients is None:
        clients = {role: list(names) for role, names in DEFAULT_CLIENTS.items()}
    clients = {role: list(clients.get(role, ())) for role in DEFAULT_CLIENTS}
    _check_names(out, clients)
    ensure_dir(out)
    report = []
    public, secret, created = _write_pair(out, BROKER_NAME)
    report.append(f"{'wrote' if created else 'kept '} {secret} (+ {public.name})")
    for role, names in clients.items():
        authorized = out / AUTHORIZED_SUBDIR / role
        ensure_dir(authorized)
        for name in names:
            public, secret, created = _write_pair(out, name)
            report.append(
                f"{'wrote' if created else 'kept '} {secret} (+ {public.name})")
            listed = authorized / public.name
            shutil.copyfile(public, listed)
            os.chmod(listed, 0o644)
        report.append(f"authorized {role} keys: {authorized}")
    stale = sorted(p.name for p in (out / AUTHORIZED_SUBDIR).glob("*.key"))
    if stale:
        # Left by an older keygen: the broker no longer reads them (they
        # had no role), but the operator should see they are dead weight.
        report.append(
            f"note: {out / AUTHORIZED_SUBDIR} still holds role-less keys "
            f"({', '.join(stale)}); nothing reads them now, delete them")
    return report


def run_keygen(args: argparse.Namespace) -> int:
    """``llamapool keygen``; returns the exit code."""
    if args.client:
        print("llamapool keygen: --client is gone: keys have roles now; use "
              "--worker NAME or --frontend NAME")
        return ExitCode.USAGE
    clients = None
    if args.worker or args.frontend:
        clients = {curve.WORKERS: args.worker, curve.FRONTENDS: args.frontend}
    try:
        report = write_keys(args.dir, clients)
    except (ValueError, OSError) as exc:
        print(f"llamapool keygen: {exc}")
        return ExitCode.USAGE
    for line in report:
        print(line)
    return ExitCode.OK
