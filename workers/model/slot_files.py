"""llama-server's slot actions on a worker: save, restore and erase its KV sequence.

``POST /slots/{id}?action=save|restore|erase`` reaches the worker that owns
slot ``id`` as a SLOT_ACTION (``protocol.messages``); the broker leased the
slot for it as for a job, so no generation runs meanwhile. The runner
(``workers.model.job_runner``) runs it here, in the main thread, which owns
the KV cache, and answers one SLOT_DONE.

A file is the prompt-state cache's own unit (``prompt_cache.CachedState``:
the sequence's state from ``llama_state_seq_get_data``, its exact tokens,
the identity of the model that made it, its tenant and the CRC32 of the
state), loaded back through the same checks as a cached state
(``prompt_reuse.PromptReuse.load_state``). So a file made by another model,
or damaged, is refused with llama-server's 400, never loaded: llama.cpp
checks a state's layout, not its contents. The whole file carries a second
CRC32 (of everything but the magic), so damaged tokens are found too.

Files live in the worker's ``--slot-save-path`` (where its KV cache is),
under a bare name that passes llama.cpp's ``fs_validate_filename``; a name
that resolves outside the directory (a symlink) is refused the same way.
Tenants (issue 29): a save writes only the caller's own tokens (a slot that
holds another key's prompt saves as empty), and a restore loads only a file
saved in the caller's scope, so no key reads or reuses another's prompt
through a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import tempfile
import time
import zlib

import msgpack
import numpy as np

from protocol import messages
from protocol.errors import ErrorCode
from protocol.settings import ConfigError
from protocol.slot_filename import INVALID_FILENAME, valid_filename
from workers.model.prompt_cache import CachedState

log = logging.getLogger("llamapool.worker")

#: What opens every slot file: the format's name and version.
MAGIC = b"LLAMAPOOL-SLOT\x00\x01"
_U32 = struct.Struct("<I")
#: The msgpack header is five scalars; anything longer is not ours.
_MAX_HEADER_BYTES = 4096

#: llama-server's words (``server-context.cpp``), so clients that match them
#: keep working.
NO_SAVE_PATH = ("This server does not support slots action. "
                "Start it with `--slot-save-path`")
NOT_SUPPORTED = "slot actions are not supported by this worker"


class SlotFileError(Exception):
    """A file that cannot be restored; the message says why."""


def encode(state: CachedState) -> bytes:
    """A slot file's bytes for ``state``."""
    header = msgpack.packb([state.model_id, state.tenant, len(state.tokens),
                            len(state.data), state.crc32])
    body = (_U32.pack(len(header)) + header
            + np.asarray(state.tokens, dtype="<i4").tobytes() + state.data)
    return MAGIC + body + _U32.pack(zlib.crc32(body))


def decode(raw: bytes) -> CachedState:
    """The state a slot file holds (its model and checksum not yet judged:
    ``PromptReuse.load_state`` does that).

    Raises:
        SlotFileError: not a slot file, or damaged.
    """
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
        raise SlotFileError("not a slot file")
    body, trailer = raw[len(MAGIC):-4], raw[-4:]
    if zlib.crc32(body) != _U32.unpack(trailer)[0]:
        raise SlotFileError("the file is damaged (checksum)")
    (n_header,) = _U32.unpack_from(body)
    if n_header > _MAX_HEADER_BYTES or 4 + n_header > len(body):
        raise SlotFileError("the file is damaged (header)")
    try:
        header = msgpack.unpackb(body[4:4 + n_header], raw=False)
        model_id, tenant, n_tokens, n_data, crc = header
    except Exception:  # msgpack raises several unrelated types
        raise SlotFileError("the file is damaged (header)") from None
    if not (isinstance(model_id, str) and isinstance(tenant, str)
            and all(isinstance(v, int) and v >= 0 for v in (n_tokens, n_data, crc))
            and 4 + n_header + 4 * n_tokens + n_data == len(body)):
        raise SlotFileError("the file is damaged (sizes)")
    start = 4 + n_header
    tokens = np.frombuffer(body, dtype="<i4", count=n_tokens,
                           offset=start).astype(np.intc)
    data = body[start + 4 * n_tokens:]
    return CachedState(tokens, data, model_id, (), crc, tenant)


class SlotTask:
    """A SLOT_ACTION while it runs: what the link thread needs of a job
    (``worker_link.WorkerLink``: its id, cancel, heartbeat progress)."""

    #: Not decoding: a THREADS budget is in force at once.
    paused = True

    def __init__(self, msg: messages.SlotAction) -> None:
        self.action = msg
        self.job_id = msg.job_id
        self.ended_by_shutdown = False
        self.orphaned = False

    def cancel(self) -> None:
        """An action is one short native call: nothing to stop between."""

    def add_credit(self, frames: int) -> None:
        """An action sends one frame, under no credit."""

    def progress(self) -> None:
        return None


class SlotFiles:
    """Runs slot actions on an engine; files under ``save_dir`` ("": save
    and restore refused, erase still works).

    Raises:
        ConfigError: ``save_dir`` cannot be created.
    """

    def __init__(self, save_dir: str) -> None:
        self.save_dir = ""
        if save_dir:
            try:
                os.makedirs(save_dir, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"--slot-save-path {save_dir}: {exc}") from None
            self.save_dir = os.path.realpath(save_dir)

    def run(self, task: SlotTask, engine) -> messages.SlotDone:
        """Run the action; its SLOT_DONE, success or refusal (never raises)."""
        msg = task.action
        started = time.perf_counter()

        def refused(code: ErrorCode, message: str) -> messages.SlotDone:
            return messages.SlotDone(msg.job_id, msg.action, code=code,
                                     message=message[:1000])

        reuse = getattr(engine, "slot_reuse", None)
        if task.ended_by_shutdown:
            return refused(ErrorCode.WORKER_SHUTDOWN, "the worker is shutting down")
        if reuse is None:
            return refused(ErrorCode.SLOT_ACTIONS_UNSUPPORTED, NOT_SUPPORTED)
        if msg.action == "erase":
            n = reuse.live_length() if msg.tenant == reuse.live_tenant else 0
            reuse.clear_live()
            return messages.SlotDone(msg.job_id, "erase", n_tokens=n)
        if not self.save_dir:
            return refused(ErrorCode.SLOT_ACTIONS_UNSUPPORTED, NO_SAVE_PATH)
        path = self._path(msg.filename)
        if path is None:
            return refused(ErrorCode.INVALID_SLOT_FILE, INVALID_FILENAME)
        try:
            if msg.action == "save":
                n_tokens, n_bytes = self._save(reuse, path, msg.tenant)
            else:
                n_tokens, n_bytes = self._restore(reuse, path, msg.tenant)
        except SlotFileError as exc:
            return refused(ErrorCode.INVALID_SLOT_FILE,
                           f"Unable to restore slot: {exc}")
        except OSError as exc:  # the directory: full, read-only, ...
            return refused(ErrorCode.ENGINE_ERROR,
                           f"Unable to {msg.action} slot: {exc.strerror or exc}")
        except Exception:
            log.exception("slot %s failed", msg.action)
            return refused(ErrorCode.ENGINE_ERROR, f"Unable to {msg.action} slot")
        ms = (time.perf_counter() - started) * 1000
        return messages.SlotDone(msg.job_id, msg.action, n_tokens, n_bytes, ms)

    def _path(self, filename: str) -> str | None:
        """The file's path, or None: not a bare valid name, or one that
        resolves outside the directory."""
        if not valid_filename(filename):
            return None
        path = os.path.join(self.save_dir, filename)
        if os.path.dirname(os.path.realpath(path)) != self.save_dir:
            return None
        return path

    def _save(self, reuse, path: str, tenant: str) -> tuple[int, int]:
        state = reuse.live_state(tenant)
        raw = encode(state)
        # Whole or not at all: a crash mid-write leaves the old file.
        fd, tmp = tempfile.mkstemp(dir=self.save_dir, prefix=".slot-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(raw)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return len(state.tokens), len(raw)

    def _restore(self, reuse, path: str, tenant: str) -> tuple[int, int]:
        try:
            with open(path, "rb") as src:
                raw = src.read()
        except FileNotFoundError:
            raise SlotFileError(f"no file {os.path.basename(path)!r}") from None
        except OSError as exc:  # a directory of that name, no permission
            raise SlotFileError(f"cannot read {os.path.basename(path)!r}: "
                                f"{exc.strerror or exc}") from None
        state = decode(raw)
        if state.tenant != tenant:
            raise SlotFileError("the file was saved under another API key's "
                                "cache scope")
        why = reuse.load_state(state)
        if why:
            raise SlotFileError(why)
        return len(state.tokens), len(raw)
