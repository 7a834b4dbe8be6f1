"""SIGTERM handled at any point of ``StopFlag.wait`` sets the flag and
never hangs.

``llamapool up`` sleeps in ``stop.wait(0.5)`` on its main thread, which is
also where Python runs the SIGTERM handler. When the flag was a
``threading.Event``, ``wait`` held the Event's lock for a few lines, and a
handler that ran there blocked in ``set()`` on that same lock forever: ``up``
hung on SIGTERM once in CI (``tests/test_flash_attn.py``).

Here the signal is raised from a trace function at every line that ``wait``
runs, its callees included, so every point of it is tried, not just the
likely ones.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from llamapool.signals import StopFlag

#: Short, so that the lines ``wait`` runs after its timeout are reached too.
WAIT_S = 0.05
#: Only bounds how long a regression takes to fail.
WATCHDOG_S = 10.0


class Hung(Exception):
    pass


def _lines_run_by_wait() -> int:
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    flag = StopFlag()
    sys.settrace(tracer)
    try:
        flag.wait(WAIT_S)
    finally:
        sys.settrace(None)
    return count


def test_sigterm_at_any_line_of_wait_sets_the_flag_and_returns():
    lines = _lines_run_by_wait()
    assert lines > 0
    main = threading.main_thread().ident
    previous_usr2 = signal.signal(signal.SIGUSR2, lambda *_: (_ for _ in ()).throw(
        Hung("the SIGTERM handler blocked inside StopFlag.wait")))
    previous_term = signal.getsignal(signal.SIGTERM)
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        for target in range(1, lines + 1):
            flag = StopFlag().install()
            seen = 0

            def tracer(frame, event, arg, target=target):
                nonlocal seen
                if event == "line":
                    seen += 1
                    if seen == target:
                        os.kill(os.getpid(), signal.SIGTERM)
                return tracer

            done = threading.Event()

            def watchdog(done=done):
                if not done.wait(WATCHDOG_S):
                    signal.pthread_kill(main, signal.SIGUSR2)

            guard = threading.Thread(target=watchdog, daemon=True)
            guard.start()
            sys.settrace(tracer)
            try:
                flag.wait(WAIT_S)
            finally:
                sys.settrace(None)
                done.set()
                guard.join()
            assert flag.is_set(), f"SIGTERM at line {target} of {lines} was lost"
    finally:
        signal.signal(signal.SIGUSR2, previous_usr2)
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)
