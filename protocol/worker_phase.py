"""What a model worker is doing, kept in a file for whoever sees it die.

A native crash (SIGSEGV in a llama.cpp kernel) kills the process between two
Python bytecodes: nothing in it can log what it was doing. So the worker
keeps one short line in a file, rewritten in place at each change of phase
(``loading``, ``warm-up``, ``idle``, ``job <id>``), and its supervisor
(``llamapool up``, or the systemd unit's ``ExecStopPost=llamapool
exit-report``) reads the line once the process has died, to say "killed by
SIGSEGV during warm-up" instead of a bare exit status.

The line is padded to a fixed width and written with one ``pwrite`` at
offset 0, so a reader never sees a half-written phase, and a job costs two
small writes, nothing per token.
"""

from __future__ import annotations

import os
import signal

LOADING = "loading"
WARM_UP = "warm-up"
IDLE = "idle"

#: Width of the padded line: "job " and the longest job id
#: (``protocol.limits.MAX_ID_CHARS``), with room to spare.
_WIDTH = 160


def job_phase(job_id: str) -> str:
    return f"job {job_id}"


class PhaseFile:
    """The worker's side: ``set`` the phase. A ``PhaseFile(None)`` (no
    ``--phase-file``) records nothing."""

    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                               | os.O_CLOEXEC, 0o600)

    def set(self, phase: str) -> None:
        if self._fd is None:
            return
        line = phase.encode("utf-8", "replace")[:_WIDTH - 1]
        os.pwrite(self._fd, line.ljust(_WIDTH - 1) + b"\n", 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_phase(path: str | None) -> str:
    """The last phase a worker wrote to ``path`` ("" if none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            return f.read(_WIDTH).decode("utf-8", "replace").strip()
    except OSError:
        return ""


#: The exit status of a worker that ended its own process because a job it
#: was told to cancel did not end within ``--cancel-timeout-s``: the job's
#: thread is stuck in native code, where no signal but SIGKILL reaches it
#: (``workers.model.worker_link``). ``llamapool.exit_codes`` names it too.
CANCEL_TIMEOUT_EXIT = 8


def describe_exit(returncode: int, phase: str = "") -> str:
    """``killed by SIGSEGV during job 3f2a``: how a process ended, from
    ``Popen.returncode`` (negative: the signal that killed it)."""
    if returncode == CANCEL_TIMEOUT_EXIT:
        how = (f"exited with {returncode} (a cancelled job stuck in native "
               "code past --cancel-timeout-s)")
    elif returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exited with {returncode}"
    return f"{how} during {phase}" if phase else how
