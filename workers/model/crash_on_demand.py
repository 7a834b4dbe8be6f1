"""A native crash on demand, for the tests of what follows one (test-only).

The crash the pool must survive happens inside llama.cpp (a SIGSEGV in a
matmul kernel on an AMX CPU: ``workers.model.weight_repack``), on CPUs the
test machine may not have. ``LLAMAPOOL_TEST_CRASH`` in a worker's
environment makes it fault the same way, a real invalid read in native code,
at a chosen point:

* ``warm-up``: in every warm-up, before READY;
* ``job``: at the start of every job, before its first token;
* ``once:PATH``: at the start of a job, if this worker is the one that
  removes the file PATH (one crash in a whole pool, whichever worker).

Unset (always, outside tests) it costs one comparison per job.
"""

from __future__ import annotations

import ctypes
import os

#: Read once: the point is fixed for the process's life.
_WHERE = os.environ.get("LLAMAPOOL_TEST_CRASH", "")

WARM_UP = "warm-up"
JOB = "job"


def crash_if_asked(point: str) -> None:
    """Fault with SIGSEGV here if ``LLAMAPOOL_TEST_CRASH`` names ``point``."""
    if not _WHERE:
        return
    if _WHERE == point or (point == JOB and _WHERE.startswith("once:")
                           and _claim(_WHERE[len("once:"):])):
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as in a kernel


def _claim(path: str) -> bool:
    try:
        os.unlink(path)  # only one process can remove it
    except OSError:
        return False
    return True
