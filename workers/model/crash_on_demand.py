"""A native crash or hang on demand, for the tests of what follows one
(test-only).

The crash the pool must survive happens inside llama.cpp (a SIGSEGV in a
matmul kernel on an AMX CPU: ``workers.model.weight_repack``), on CPUs the
test machine may not have. ``LLAMAPOOL_TEST_CRASH`` in a worker's
environment makes it fault the same way, a real invalid read in native code,
at a chosen point:

* ``warm-up``: in every warm-up, before READY;
* ``job``: at the start of every job, before its first token;
* ``once:PATH``: at the start of a job, if this worker is the one that
  removes the file PATH (one crash in a whole pool, whichever worker).

The hang is a job that never leaves one C call, as one that llama.cpp's
grammar engine pins does (issue 29: 2^20 grammar stacks, one token taking
minutes): ``LLAMAPOOL_TEST_HANG`` takes the same points (``job`` or
``once:PATH``), and the job's thread then waits in libc's ``pause()`` for
good. ctypes releases the GIL for that call, as for a llama.cpp decode, so
the link thread goes on heartbeating; and SIGTERM and SIGINT are blocked in
that thread first, so they land in another one and Python's handler, which
only the main thread runs, never runs: the process sees SIGTERM no more than
a worker stuck in a decode does. Only SIGKILL, or the process ending itself
(``workers.model.worker_link``'s cancel deadline), ends it.

Unset (always, outside tests) each costs one comparison per job.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: Read once: the point is fixed for the process's life.
_WHERE = os.environ.get("LLAMAPOOL_TEST_CRASH", "")
_HANG_WHERE = os.environ.get("LLAMAPOOL_TEST_HANG", "")

WARM_UP = "warm-up"
JOB = "job"


def crash_if_asked(point: str) -> None:
    """Fault with SIGSEGV here if ``LLAMAPOOL_TEST_CRASH`` names ``point``,
    or hang here for good if ``LLAMAPOOL_TEST_HANG`` does."""
    if _WHERE and _asked(_WHERE, point):
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as in a kernel
    if _HANG_WHERE and _asked(_HANG_WHERE, point):
        _hang_in_c()


def _asked(where: str, point: str) -> bool:
    return where == point or (point == JOB and where.startswith("once:")
                              and _claim(where[len("once:"):]))


def _hang_in_c() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    libc = ctypes.CDLL(None, use_errno=True)
    while True:  # pause() returns only for a signal this thread handles
        libc.pause()


def _claim(path: str) -> bool:
    try:
        os.unlink(path)  # only one process can remove it
    except OSError:
        return False
    return True
