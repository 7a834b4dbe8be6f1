"""API keys as records: a name, a hash, and limits (``--keys-file``).

The file is TOML, one ``[[key]]`` table per key::

    [[key]]
    name = "team-a"                 # in logs and metrics, never the key
    sha256 = "9f86d081884c7d65..."  # printf %s "$KEY" | sha256sum
    max_slots = 2                   # optional: jobs running at once
    max_queued = 4                  # optional: jobs waiting for a slot
    tokens_per_minute = 20000       # optional: prompt + completion tokens

No plaintext key is in the file. A key is checked by hashing what the
request presents and comparing, in constant time, with every record's hash.
The limits travel in each job's SUBMIT (``payloads.KeyPolicy``) and are
enforced at the broker (``workers.broker.key_limits``), so several frontends
do not multiply them. With several brokers each gets its share of every
limit, rounded up (``policy_for``): the pool-wide overshoot is below one job
(or one share of tokens) per broker.

The file is read again when it changes (its modification time and size are
looked at most once a second, on requests) and on SIGHUP, which gunicorn
answers by starting fresh workers that read it. A file that no longer
parses keeps the records read before, with an error logged once per change.
``--api-key`` and ``--api-key-file`` keep working beside it: their keys have
no name and no limits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
import tomllib
from typing import Any

from protocol import limits
from protocol.payloads import KeyPolicy

log = logging.getLogger("llamapool.frontend")

#: How often a request may look at the file for a change.
RELOAD_CHECK_S = 1.0
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,%d}$" % limits.MAX_KEY_NAME_CHARS)
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LIMITS = ("max_slots", "max_queued", "tokens_per_minute")
_FIELDS = frozenset({"name", "sha256", *_LIMITS})


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the entry."""


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    name: str
    sha256: bytes
    max_slots: int = 0
    max_queued: int = 0
    tokens_per_minute: int = 0

    def policy(self, brokers: int = 1) -> KeyPolicy:
        """The limits for one of ``brokers`` brokers: a share of each,
        rounded up (0 stays no limit)."""
        def share(n: int) -> int:
            return math.ceil(n / brokers) if n else 0
        return KeyPolicy(self.name, share(self.max_slots), share(self.max_queued),
                         share(self.tokens_per_minute))


def parse_keys(text: str) -> tuple[KeyRecord, ...]:
    """The records of a keys file's text.

    Raises:
        KeysFileError: not TOML, an unknown or missing field, a bad name,
            hash or limit, or a name or hash given twice.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"not TOML: {exc}") from None
    extra = set(doc) - {"key"}
    if extra:
        raise KeysFileError(f"unknown top-level entries {sorted(extra)}: "
                            "only [[key]] tables")
    entries = doc.get("key", [])
    if not isinstance(entries, list):
        raise KeysFileError("'key' must be [[key]] tables")
    records = tuple(_record(entry, i) for i, entry in enumerate(entries))
    for field in ("name", "sha256"):
        seen: set = set()
        for r in records:
            value = getattr(r, field)
            if value in seen:
                shown = r.name if field == "name" else "a hash"
                raise KeysFileError(f"{shown!r} is given twice ({field})")
            seen.add(value)
    return records


def _record(entry: Any, i: int) -> KeyRecord:
    where = f"key[{i}]"
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where} must be a table")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise KeysFileError(f"{where}.name must be 1-{limits.MAX_KEY_NAME_CHARS} "
                            "letters, digits, '_', '.' or '-'")
    where = f"key {name!r}"
    unknown = set(entry) - _FIELDS
    if unknown:
        raise KeysFileError(f"{where}: unknown fields {sorted(unknown)}")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _HEX.match(digest.lower()):
        raise KeysFileError(f"{where}: sha256 must be 64 hex digits (the key's "
                            "SHA-256, never the key)")
    values = {}
    for field in _LIMITS:
        value = entry.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                0 <= value <= 2**31):
            raise KeysFileError(f"{where}: {field} must be a whole number >= 0")
        values[field] = value
    return KeyRecord(name, bytes.fromhex(digest.lower()), **values)


def read_keys_file(path: str) -> tuple[KeyRecord, ...]:
    """Raises KeysFileError (naming the file) or OSError."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    try:
        return parse_keys(text)
    except KeysFileError as exc:
        raise KeysFileError(f"{path}: {exc}") from None


@functools.lru_cache(maxsize=4)
def startup_digests(path: str) -> tuple[bytes, ...]:
    """The hashes of a keys file as this process first read it ("" : none):
    what the cache scope's secret is made of, so that every frontend started
    with one file tells keys apart alike (``frontend.cache_scope``)."""
    return tuple(r.sha256 for r in read_keys_file(path)) if path else ()


class KeyRecords:
    """The records of one keys file, read again when it changes.

    Raises (at construction): KeysFileError or OSError.
    """

    def __init__(self, path: str, clock=time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self.records = read_keys_file(path)
        self._checked = clock()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            if now - self._checked < RELOAD_CHECK_S:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self.records = read_keys_file(self.path)
            except (KeysFileError, OSError, UnicodeDecodeError) as exc:
                log.error("keys file not reloaded, the %d keys read before stay: "
                          "%s", len(self.records), exc)
                return
            log.info("keys file reloaded: %d keys", len(self.records))

    def lookup(self, candidate: str) -> KeyRecord | None:
        """The record of the key presented, or None. Every record's hash is
        compared (constant time in which one matches)."""
        self._maybe_reload()
        digest = hashlib.sha256(candidate.encode("utf-8", "surrogateescape")).digest()
        found = None
        for record in self.records:
            if hmac.compare_digest(digest, record.sha256):
                found = record
        return found
