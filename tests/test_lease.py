"""The slot lease: any interleaving of EOF, error, close and GC releases once.

A hypothesis state machine drives a real ``EventStreamBody`` and its
``SlotLease`` the way gunicorn and the broker link would: frames arrive,
gunicorn reads events, the client disconnects (``close``), a thread dies and
the body is garbage-collected.
"""

from __future__ import annotations

import gc
import threading

from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from frontend.broker_link import JobStream
from frontend.lease import SlotLease
from frontend.openai_format import ResponseShaper
from frontend.sse import EventStreamBody, JobOutcome
from protocol import messages


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
        self.body = EventStreamBody(
            self.lease, self.stream, ResponseShaper("completion", "r", "m"),
            messages.Token("job", "first"), frame_timeout_s=0.001,
            credit_batch_frames=2, send=self.rec.send, outcome=JobOutcome(),
        )
        self.queued = 0
        self.terminal_sent = False
        self.finished_reading = False

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_sends_token(self):
        self.stream.put(messages.Token("job", "t"))
        self.queued += 1

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_sends_final(self):
        self.stream.put(messages.Final("job", "stop", {}, {}))
        self.terminal_sent = True

    @precondition(lambda self: not self.terminal_sent)
    @rule()
    def worker_or_link_sends_error(self):
        self.stream.put(messages.Error("job", "worker_died", "x", 502))
        self.terminal_sent = True

    @precondition(lambda self: self.body is not None and not self.finished_reading)
    @rule()
    def gunicorn_reads_an_event(self):
        try:
            event = next(self.body)
        except StopIteration:
            self.finished_reading = True
            return
        if b"[DONE]" in event or b'"error"' in event:
            self.finished_reading = True

    @precondition(lambda self: self.body is not None)
    @rule()
    def client_disconnects(self):
        self.body.close()

    @precondition(lambda self: self.body is not None)
    @rule()
    def body_is_garbage_collected(self):
        self.body = None
        gc.collect()

    @rule()
    def a_second_release_path_races(self):
        # e.g. the responder's setup-failure path after hand-over.
        threads = [threading.Thread(target=self.lease.release, args=("setup_failed",))
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
    def cancel_only_if_job_was_not_over(self):
        if self.rec.released:
            ending = self.rec.released[0]
            assert bool(self.rec.cancels) == (ending not in ("eof", "error", "refused"))

    def teardown(self):
        self.body = None
        gc.collect()
        assert len(self.rec.released) == 1, self.rec.released
        assert self.rec.forgotten == ["job"]


TestLease = LeaseMachine.TestCase
TestLease.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)


def test_setup_failure_releases_with_cancel():
    rec = Recorder()
    lease = SlotLease("j", rec.send, rec.forget, rec.on_release)
    assert lease.release("setup_failed") is True
    assert lease.release("gc") is False
    assert rec.released == ["setup_failed"] and len(rec.cancels) == 1


def test_refused_releases_without_cancel():
    rec = Recorder()
    lease = SlotLease("j", rec.send, rec.forget, rec.on_release)
    lease.release("refused")
    lease.release("setup_failed")
    assert rec.released == ["refused"] and rec.cancels == []


def test_credit_is_returned_as_events_are_consumed():
    rec = Recorder()
    stream = JobStream("j")
    lease = SlotLease("j", rec.send, rec.forget)
    body = EventStreamBody(lease, stream, ResponseShaper("chat", "r", "m"),
                           messages.Token("j", "a"), frame_timeout_s=1,
                           credit_batch_frames=2, send=rec.send, outcome=JobOutcome())
    for _ in range(4):
        stream.put(messages.Token("j", "b"))
    stream.put(messages.Final("j", "length", {}, {}))
    events = list(body)
    assert events[-1].endswith(b"data: [DONE]\n\n")
    credits = [m.frames for m in rec.sent if isinstance(m, messages.Credit)]
    assert sum(credits) >= 4 and all(c >= 2 for c in credits)
