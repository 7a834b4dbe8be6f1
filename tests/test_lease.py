"""The slot lease: any interleaving of EOF, error, close and GC releases once.

A hypothesis state machine drives a real ``EventStreamBody``, its ``Job`` and
``SlotLease`` the way gunicorn and the broker link would: frames arrive,
gunicorn reads events (or waits past the frame timeout), the client
disconnects (``close``), a thread dies and the body is garbage-collected.

Whether CANCEL must go out is decided by the model from its own events, not
from ``LeaseEnding``: the job is over at the broker only if the first thing
that ended it was the broker's terminal frame reaching the body (or, outside
the machine, a refusal). Anything that happened here first (a timeout, a
disconnect, GC, a racing release) leaves the worker running, so it cancels.
"""

from __future__ import annotations

import gc
import threading

from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from frontend.broker_link import JobStream
from frontend.job import Job, JobOutcome
from frontend.lease import LeaseEnding, SlotLease
from frontend.openai_format import ResponseShaper
from frontend.sse import EventStreamBody
from protocol import messages
from protocol.payloads import Timings, Usage

#: usage and timings of a FINAL that says nothing was used.
NOTHING_USED = (Usage(0, 0, 0), Timings(0, 0.0, 0, 0.0))

#: ``--merge-waiting-frames`` as operations.md suggests it for slow links:
#: TOKEN frames already queued go out as one event.
MERGE_FRAMES_MAX = 64


class Recorder:
    def __init__(self) -> None:
        self.sent: list[messages.Message] = []
        self.forgotten: list[str] = []
        self.released: list[str] = []

    def send(self, msg):
        self.sent.append(msg)

    def forget(self, job_id):
        self.forgotten.append(job_id)

    def on_release(self, lease):
        self.released.append(lease.ending)

    @property
    def cancels(self):
        return [m for m in self.sent if isinstance(m, messages.Cancel)]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rec = Recorder()
        self.stream = JobStream("job")
        self.lease = SlotLease("job", self.rec.send, self.rec.forget,
                               self.rec.on_release)
        self.job = Job(self.lease, self.stream, send=self.rec.send,
                       frame_timeout_s=0.001, credit_batch_frames=2,
                       merge_frames_max=MERGE_FRAMES_MAX, outcome=JobOutcome())
        self.stream.put(messages.Token("job", "first"))
        self.job.first_frame()
        self.body = EventStreamBody(self.job, ResponseShaper("completion", "r", "m"))
        self.queued = 0
        self.terminal_sent = False
        self.finished_reading = False
        # The model: frames the body has yet to read (the first is pending),
        # whether the body still reads, and what ended the job, in order.
        self.unread = ["token"]
        self.body_reads = True
        self.endings: list[str] = []

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_sends_token(self):
        self.stream.put(messages.Token("job", "t"))
        self.queued += 1
        self.unread.append("token")

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_sends_final(self):
        self.stream.put(messages.Final("job", "stop", *NOTHING_USED))
        self.terminal_sent = True
        self.unread.append("terminal")

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_or_link_sends_error(self):
        self.stream.put(messages.Error("job", "worker_died", "x"))
        self.terminal_sent = True
        self.unread.append("terminal")

    @precondition(lambda self: self.body is not None and not self.finished_reading)
    @rule()
    def gunicorn_reads_an_event(self):
        if self.body_reads:
            self.body_reads = False
            if not self.unread:
                self.endings.append("no frame within the frame timeout")
            elif self.unread.pop(0) == "terminal":
                self.endings.append("terminal frame from the broker")
            else:
                # The tokens queued behind it go out in the same event.
                merged = 1
                while self.unread[:1] == ["token"] and merged < MERGE_FRAMES_MAX:
                    self.unread.pop(0)
                    merged += 1
                self.body_reads = True
        try:
            event = next(self.body)
        except StopIteration:
            self.finished_reading = True
            return
        if b"[DONE]" in event or b'"error"' in event:
            self.finished_reading = True

    @precondition(lambda self: self.body is not None and not self.finished_reading)
    @rule()
    def gunicorn_reads_until_the_stream_ends(self):
        # A client that keeps reading: every frame queued so far, then the
        # terminal frame or, if none was queued, the frame timeout.
        while not self.finished_reading:
            self.gunicorn_reads_an_event()

    @precondition(lambda self: self.body is not None)
    @rule()
    def client_disconnects(self):
        self.body_reads = False
        self.endings.append("client disconnected")
        self.body.close()

    @precondition(lambda self: self.body is not None)
    @rule()
    def body_is_garbage_collected(self):
        self.body_reads = False
        self.endings.append("body garbage-collected")
        self.body = None
        gc.collect()

    @rule()
    def a_second_release_path_races(self):
        # e.g. the responder's setup-failure path after hand-over.
        self.endings.append("a release path here")
        threads = [threading.Thread(target=self.lease.release,
                                    args=(LeaseEnding.SETUP_FAILED,))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @invariant()
    def released_at_most_once(self):
        assert len(self.rec.released) <= 1
        assert len(self.rec.forgotten) == len(self.rec.released)
        assert len(self.rec.cancels) <= 1

    @invariant()
    def released_once_anything_ended_it(self):
        assert bool(self.rec.released) == bool(self.endings), self.endings

    @invariant()
    def cancel_unless_the_broker_ended_the_job_first(self):
        if self.endings:
            over_remotely = self.endings[0] == "terminal frame from the broker"
            assert bool(self.rec.cancels) == (not over_remotely), self.endings

    def teardown(self):
        self.body = None
        gc.collect()
        assert len(self.rec.released) == 1, self.rec.released
        assert self.rec.forgotten == ["job"]


TestLease = LeaseMachine.TestCase
TestLease.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
# The rules' gc.collect() scanned every object of the whole test session each
# time (70 ms apiece with llama-cpp-python and numpy loaded: most of the unit
# tier's time). Frozen, what existed before the test is left out; every
# body and lease the examples make is still collected.
TestLease.setUpClass = classmethod(lambda cls: gc.freeze())
TestLease.tearDownClass = classmethod(lambda cls: gc.unfreeze())


def test_setup_failure_releases_with_cancel():
    rec = Recorder()
    lease = SlotLease("j", rec.send, rec.forget, rec.on_release)
    assert lease.release(LeaseEnding.SETUP_FAILED) is True
    assert lease.release(LeaseEnding.GC) is False
    assert rec.released == ["setup_failed"] and len(rec.cancels) == 1


def test_refused_releases_without_cancel():
    rec = Recorder()
    lease = SlotLease("j", rec.send, rec.forget, rec.on_release)
    lease.release(LeaseEnding.REFUSED)
    lease.release(LeaseEnding.SETUP_FAILED)
    assert rec.released == ["refused"] and rec.cancels == []


def test_credit_is_returned_as_events_are_consumed():
    rec = Recorder()
    stream = JobStream("j")
    lease = SlotLease("j", rec.send, rec.forget)
    job = Job(lease, stream, send=rec.send, frame_timeout_s=1, credit_batch_frames=2,
              merge_frames_max=MERGE_FRAMES_MAX, outcome=JobOutcome())
    stream.put(messages.Token("j", "a"))
    job.first_frame()
    body = EventStreamBody(job, ResponseShaper("chat", "r", "m"))
    for _ in range(4):
        stream.put(messages.Token("j", "b"))
    stream.put(messages.Final("j", "length", *NOTHING_USED))
    events = list(body)
    assert events[-1].endswith(b"data: [DONE]\n\n")
    credits = [m.frames for m in rec.sent if isinstance(m, messages.Credit)]
    assert sum(credits) >= 4 and all(c >= 2 for c in credits)
