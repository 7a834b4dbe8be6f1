"""The model worker's two sides, in process: what the job runner hands the
link is tagged with its job, and the link forwards it by that tag.

No process and no socket: the link's ``BrokerConnection`` never starts, and
what the link would write itself is recorded.
"""

from __future__ import annotations

import threading

import pytest

from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest, GpuPlacement, Timings, Usage
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.job_runner import JobRunner
from workers.model.settings import WorkerSettings
from workers.model.synthetic_engine import SyntheticEngine
from workers.model.worker import ModelWorker
from workers.model.worker_link import RegistrationState, WorkerLink

REQUEST = GenerationRequest(kind="completion", prompt="hi", max_tokens=2)
FINAL = (Usage(1, 1, 2), Timings(1, 1.0, 1, 1.0))


class LoadedEngine:
    model_name = "m"
    n_ctx = 64
    name = "synthetic"
    gpu = GpuPlacement()
    repack = ""


def registered_link() -> tuple[WorkerLink, list[messages.Message]]:
    worker = ModelWorker(WorkerSettings(broker_endpoint="ipc://nobody",
                                        engine="synthetic"), LoadedEngine)
    worker.engine = LoadedEngine()
    link = worker.link
    link._stop = threading.Event()
    link._registration.state = RegistrationState.CONFIRMED
    written: list[messages.Message] = []
    link.connection.send = lambda msg: written.append(msg)
    return link, written


def submit(link: WorkerLink, job_id: str) -> ActiveJob:
    link.on_message(messages.Submit(job_id, REQUEST))
    return link._job


def test_a_message_of_a_kind_the_link_does_not_know_raises():
    link, _ = registered_link()
    job = submit(link, "a")
    with pytest.raises(TypeError, match="Heartbeat"):
        link.forward(Outgoing(job, messages.Heartbeat()))
    with pytest.raises(TypeError, match="Ready"):
        link.forward(Outgoing(None, messages.Ready("w", "m", 64)))
    # A job frame must name its job; a bare message is not what the main
    # thread sends.
    with pytest.raises(TypeError, match="Token"):
        link.forward(Outgoing(None, messages.Token("a", "t", 1)))
    with pytest.raises(TypeError, match="bare Token"):
        link.forward(messages.Token("a", "t", 1))


def test_a_frame_of_a_job_no_longer_current_is_not_forwarded():
    link, _ = registered_link()
    first = submit(link, "j")
    assert link.forward(Outgoing(first, messages.Final("j", "stop", *FINAL)))
    # The next job reuses the id: only the tag (the job object) tells them
    # apart, and the first job's late frames stay out, its terminal one too.
    second = submit(link, "j")
    assert second is not first
    assert not link.forward(Outgoing(first, messages.Token("j", "late", 1)))
    assert not link.forward(Outgoing(first, messages.Error(
        "j", ErrorCode.ENGINE_ERROR, "late")))
    assert link._job is second  # the stale terminal frame did not end it
    assert link.forward(Outgoing(second, messages.Token("j", "t", 1)))


def test_an_orphaned_jobs_frames_stay_out_and_ready_waits_for_its_end():
    link, written = registered_link()
    job = submit(link, "a")
    link.on_lost(1.0)  # its broker is gone
    assert job.orphaned and job.should_stop()
    assert not link.forward(Outgoing(job, messages.Token("a", "t", 1)))
    link.on_tick(0.0)
    assert not any(isinstance(m, messages.Ready) for m in written)
    assert not link.forward(Outgoing(job, messages.Final("a", "cancelled",
                                                         *FINAL)))
    link.on_tick(0.0)  # the job has ended: READY to the broker we dial now
    assert any(isinstance(m, messages.Ready) for m in written)


def test_the_runner_tags_its_frames_and_reports_the_cache_before_the_end():
    class CachingEngine(SyntheticEngine):
        def prompt_cache_report(self):
            return [[1, 2]], None

    sent: list[Outgoing] = []
    settings = WorkerSettings(broker_endpoint="ipc://nobody")
    runner = JobRunner(settings, CachingEngine, send=sent.append)
    runner.engine = CachingEngine(tokens_per_second=10_000.0)
    job = ActiveJob(messages.Submit("a", REQUEST),
                    lambda frame: sent.append(Outgoing(job, frame)), settings)
    runner._run_job(job)
    *tokens, report, final = sent
    assert all(out.job is job and isinstance(out.message, messages.Token)
               for out in tokens) and len(tokens) == 2
    assert report == Outgoing(None, messages.CacheReport([[1, 2]], None))
    assert final.job is job and isinstance(final.message, messages.Final)


@pytest.mark.parametrize("asks", [dict(grammar="root ::= \"x\""),
                                  dict(logprobs=1)])
def test_the_runner_refuses_what_the_engine_cannot_do_before_it_runs(asks):
    class NeverRuns(SyntheticEngine):
        def run(self, request, sink):
            raise AssertionError("the engine saw a request it cannot serve")

    sent: list[Outgoing] = []
    runner = JobRunner(WorkerSettings(broker_endpoint="ipc://nobody"),
                       NeverRuns, send=sent.append)
    runner.engine = NeverRuns()
    job = ActiveJob(messages.Submit("a", GenerationRequest(
        kind="completion", prompt="hi", **asks)), sent.append,
        WorkerSettings(broker_endpoint="ipc://nobody"))
    runner._run_job(job)
    (end,) = sent
    assert end.job is job
    assert end.message.code == ErrorCode.UNSUPPORTED_FIELD
    assert "the synthetic engine has no" in end.message.message
