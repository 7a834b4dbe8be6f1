"""Property test: a worker that moves between brokers never serves two at once.

The real ``ModelWorker``'s link-side callbacks (its ``WorkerLink``:
``on_message``, ``on_lost``, ``forward``, ``on_tick``), driven in any order,
with its link's socket replaced by a recorder of what would go out and to
which broker. The rules:

* at most one job at a time: a SUBMIT while a job runs is refused with
  WORKER_BUSY (one slot is one job);
* a job given by one broker never sends a frame to another: after a move,
  its frames are dropped (the old broker is gone, and the new one never
  gave it);
* READY goes out only with no job, so a new broker never leases a worker
  still running an old broker's job.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest, GpuPlacement, Timings, Usage
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.settings import WorkerSettings
from workers.model.worker import ModelWorker
from workers.model.worker_link import RegistrationState, WorkerLink

REQUEST = GenerationRequest(kind="completion", prompt="hi")


class LoadedEngine:
    model_name = "m"
    n_ctx = 64
    name = "synthetic"
    gpu = GpuPlacement()
    repack = ""


def make_worker(endpoints: str) -> tuple[WorkerLink, list[tuple[str, object]]]:
    worker = ModelWorker(WorkerSettings(broker_endpoint=endpoints,
                                        engine="synthetic"), LoadedEngine)
    worker.engine = LoadedEngine()
    link = worker.link
    link._stop = threading.Event()  # a StopSignal: is_set, set
    out: list[tuple[str, object]] = []
    # What would leave the DEALER, and to which broker it is connected.
    link.connection.send = lambda msg: out.append((link.connection.endpoint, msg))
    return link, out


EVENTS = st.lists(st.sampled_from(["submit", "lost", "token", "end", "tick"]),
                  max_size=40)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(1, 3))
def test_a_moving_worker_serves_one_broker_one_job(events, n_brokers):
    endpoints = [f"ipc://b{i}" for i in range(n_brokers)]
    worker, out = make_worker(",".join(endpoints))
    #: The job the main thread runs, and the broker that gave it.
    running: tuple[str, str] | None = None
    serial = 0
    for event in events:
        before = len(out)
        if event == "submit":
            serial += 1
            job_id = f"j{serial}"
            busy = worker._job is not None
            worker.on_message(messages.Submit(job_id, REQUEST, []))
            if busy:
                (_, refusal), = out[before:]
                assert isinstance(refusal, messages.Error)
                assert refusal.code == ErrorCode.WORKER_BUSY
            else:
                assert running is None  # one job at a time
                running = (job_id, worker.connection.endpoint, worker._job)
        elif event == "lost":
            worker.on_lost(1.0)
        elif event in ("token", "end") and running is not None:
            job_id, given_by, job = running
            msg = (messages.Token(job_id, "x") if event == "token" else
                   messages.Error(job_id, ErrorCode.ENGINE_ERROR, "end"))
            if worker.forward(Outgoing(job, msg)):
                # Only ever to the broker that gave the job.
                assert worker.connection.endpoint == given_by
            if event == "end":
                running = None
        elif event == "tick":
            worker.on_tick(0.0)
            for _, msg in out[before:]:
                if isinstance(msg, messages.Ready):
                    assert worker._job is None and running is None
        # Nothing the worker says itself goes to a broker that did not give
        # the running job.
        for endpoint, msg in out[before:]:
            if running is not None and isinstance(msg, messages.Ready):
                raise AssertionError(f"READY to {endpoint} while running")


def test_a_move_goes_to_the_next_broker():
    worker, _ = make_worker("ipc://a,ipc://b")
    first = worker.connection.endpoint
    worker.on_lost(1.0)
    assert worker.connection.endpoint != first
    worker.on_lost(1.0)
    assert worker.connection.endpoint == first
    assert worker.brokers.moves == 2


def test_what_the_main_thread_sends_goes_out_by_kind_never_dropped_unsaid():
    """``forward`` (the link thread's last look at what the main thread
    queued, each message tagged with its job): a frame of the current job
    goes, one of any other job does not, and a message it does not know is
    an error, not a silent drop (it used to drop anything sent between jobs
    but CACHE_REPORT)."""
    worker, _ = make_worker("ipc://b0")
    worker._registration.state = RegistrationState.CONFIRMED
    worker.on_message(messages.Submit(
        "a", GenerationRequest(kind="completion", prompt="x")))
    a = worker._job
    b = ActiveJob(messages.Submit("b", REQUEST), send=None,
                  settings=worker.settings)
    assert worker.forward(Outgoing(a, messages.Token("a", "t", 1)))
    assert not worker.forward(Outgoing(b, messages.Token("b", "t", 1)))  # not ours
    assert worker.forward(Outgoing(a, messages.ThreadsSet(1, 1)))
    assert worker.forward(Outgoing(a, messages.Final(
        "a", "stop", Usage(1, 1, 2), Timings(1, 1.0, 1, 1.0))))
    assert not worker.forward(Outgoing(a, messages.Token("a", "late", 1)))  # ended
    assert worker.forward(Outgoing(None, messages.CacheReport([], None)))  # idle
    with pytest.raises(TypeError, match="Loading"):
        worker.forward(Outgoing(None, messages.Loading("w", "m", 1, "h")))
