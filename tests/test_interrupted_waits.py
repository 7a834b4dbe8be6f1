"""Timed waits that a signal interrupts still end at their deadline.

CPython 3.11's C ``queue.SimpleQueue.get(timeout=...)`` waits forever when a
signal interrupts it and the handler returns after the deadline: it
recomputes the time left, gets a negative number, and a negative timeout
means "no timeout" to the lock underneath. A worker that took SIGTERM in the
last moments of its 0.2 s job wait never checked its stop flag again, and
hung until SIGKILL (seen about once in ten CI runs). ``threading.Lock`` and
so ``queue.Queue`` check for the negative case.

Each test makes the handler outlast the deadline for certain, instead of
hoping a signal lands in the last microseconds: in process, a handler that
returns only after the deadline; for the real worker process, SIGSTOP held
past the deadline, then SIGTERM to its main thread, then SIGCONT.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from frontend.broker_link import BrokerLink, JobStream
from tests.pool import Proc, cli, wait_until

#: Generous: only bounds how long a regression takes to fail, on a loaded
#: machine; a wait that works returns right after the slow handler.
WATCHDOG_S = 30.0
#: The in-process waits: long enough that the signalling thread, polling
#: every millisecond, cannot miss the main thread inside one on a loaded
#: machine.
WAIT_S = 1.0


class WaitHung(Exception):
    """The watchdog's second signal found the main thread still waiting."""


def _main_thread_is_in(function_name: str) -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def a_signal_that_outlasts(function_name: str, timeout_s: float):
    """Once the main thread is inside ``function_name``, send it SIGUSR2;
    the handler returns only after ``timeout_s`` has passed since entry,
    so the wait it interrupted is past its deadline when it resumes.

    If the main thread is still waiting after ``WATCHDOG_S``, a second
    SIGUSR2 raises ``WaitHung`` out of the wait, so a regression fails the
    test instead of blocking the suite.
    """
    entered = time.monotonic()
    done = threading.Event()
    deliveries = 0

    def handler(signum, frame):
        nonlocal deliveries
        deliveries += 1
        if deliveries > 1:
            raise WaitHung(f"still in {function_name} {WATCHDOG_S}s after the signal")
        past_deadline = entered + timeout_s + 0.1
        while time.monotonic() < past_deadline:
            time.sleep(0.01)

    def signaller():
        main = threading.main_thread().ident
        wait_until(lambda: _main_thread_is_in(function_name) or done.is_set(),
                   WATCHDOG_S, f"the main thread to enter {function_name}",
                   interval_s=0.001)
        if done.is_set():
            return
        signal.pthread_kill(main, signal.SIGUSR2)
        if not done.wait(WATCHDOG_S):
            signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, handler)
    thread = threading.Thread(target=signaller, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        signal.signal(signal.SIGUSR2, previous)
    assert deliveries == 1, "the signal did not land inside the wait"


def test_a_job_streams_frame_wait_ends_when_a_signal_outlasts_it():
    stream = JobStream("job-1")
    with a_signal_that_outlasts("get", timeout_s=WAIT_S):
        assert stream.get(WAIT_S) is None


def test_a_status_wait_ends_when_a_signal_outlasts_it(tmp_path):
    link = BrokerLink(f"ipc://{tmp_path}/nobody", heartbeat_interval_s=0.2,
                      heartbeat_liveness=3)
    link.start()  # so that inside status() there is little but the wait
    try:
        with a_signal_that_outlasts("status", timeout_s=WAIT_S):
            assert link.status(timeout_s=WAIT_S) is None
    finally:
        link.close()


def _state(pid: int) -> str:
    """The one-letter state in /proc/PID/stat ('T': stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


@pytest.mark.stack
def test_an_idle_worker_stops_when_sigterm_is_handled_past_its_job_waits_deadline(
        tmp_path):
    worker = Proc("worker", cli("worker", "--broker", f"ipc://{tmp_path}/wk",
                                "--engine", "synthetic",
                                "--heartbeat-interval-s", "0.2"), tmp_path)
    try:
        wait_until(lambda: "model loaded" in worker.log(), WATCHDOG_S,
                   "the worker to reach its job loop")
        worker.popen.send_signal(signal.SIGSTOP)
        wait_until(lambda: _state(worker.pid) == "T", WATCHDOG_S,
                   "the worker to stop")
        # The fault itself, not synchronisation: stay stopped for longer
        # than the worker's 0.2 s job wait, so its deadline has passed when
        # the SIGTERM handler returns.
        time.sleep(0.5)
        # To the main thread, which runs Python's handlers and sits in the
        # job wait (a signal to the process may go to another thread).
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        assert libc.tgkill(worker.pid, worker.pid, signal.SIGTERM) == 0
        worker.popen.send_signal(signal.SIGCONT)
        # One SIGTERM only: a second would force the exit (EXIT_FORCED).
        assert worker.popen.wait(timeout=WATCHDOG_S) == 0
        assert "stopped after 0 jobs" in worker.log()
    finally:
        worker.kill()
