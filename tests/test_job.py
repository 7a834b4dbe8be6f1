"""One job's frames and the error table, in process.

``Job`` is driven through a real ``JobStream`` and ``SlotLease`` with a
recording link, the way the broker link and gunicorn drive it. The points:
every failure on this side (a frame timeout, an exception while streaming)
sends CANCEL, an ERROR frame does not, and an error looks the same whichever
way it reaches the client (HTTP answer or SSE event), because both read
``frontend.errors.HTTP_FORMS``.
"""

from __future__ import annotations

import json

import pytest

from frontend.broker_link import JobStream
from frontend.errors import (
    HTTP_FORMS,
    NoSlotAvailable,
    Unavailable,
    UpstreamError,
    http_form,
)
from frontend.frame_merge import MERGED_TEXT_MAX_CHARS
from frontend.generation import collect
from frontend.job import Job, JobOutcome
from frontend.lease import LeaseEnding, SlotLease
from frontend.openai_format import ResponseShaper
from frontend.sse import EventStreamBody
from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import Timings, TokenLogprob, Usage

#: ``--merge-waiting-frames`` as operations.md suggests it for slow links.
MERGE_FRAMES_MAX = 64

#: usage and timings of a FINAL that says nothing was used.
NOTHING_USED = (Usage(0, 0, 0), Timings(0, 0.0, 0, 0.0))


class Link:
    """Records what the job sends and which leases ended how."""

    def __init__(self) -> None:
        self.sent: list[messages.Message] = []
        self.endings: list[LeaseEnding] = []

    def send(self, msg: messages.Message) -> None:
        self.sent.append(msg)

    def forget(self, job_id: str) -> None:
        pass

    def on_release(self, lease: SlotLease) -> None:
        self.endings.append(lease.ending)

    @property
    def cancels(self) -> list[messages.Cancel]:
        return [m for m in self.sent if isinstance(m, messages.Cancel)]


def started_job(link: Link, *frames: messages.Message,
                frame_timeout_s: float = 1.0,
                merge_frames_max: int = MERGE_FRAMES_MAX) -> Job:
    """A job past setup: ACCEPTED read, first frame waiting, ``frames`` queued."""
    stream = JobStream("j")
    lease = SlotLease("j", link.send, link.forget, link.on_release)
    job = Job(lease, stream, send=link.send, frame_timeout_s=frame_timeout_s,
              credit_batch_frames=2, merge_frames_max=merge_frames_max,
              outcome=JobOutcome())
    stream.put(messages.Accepted("j", 3, "m"))
    for frame in frames:
        stream.put(frame)
    assert isinstance(job.answer(1.0), messages.Accepted)
    job.first_frame()
    return job


def sse_error(event: bytes) -> dict:
    assert event.startswith(b"data: ") and b"[DONE]" not in event
    return json.loads(event[len(b"data: "):])["error"]


# --- lease endings -------------------------------------------------------------------


def test_eof_and_remote_error_send_no_cancel():
    link = Link()
    job = started_job(link, messages.Token("j", "a"),
                      messages.Final("j", "stop", *NOTHING_USED))
    text, final, _ = collect(job)
    assert (text, final.finish_reason) == ("a", "stop")
    link2 = Link()
    job2 = started_job(link2, messages.Token("j", "a"),
                       messages.Error("j", ErrorCode.WORKER_DIED, "gone"))
    with pytest.raises(UpstreamError) as failed:
        collect(job2)
    assert failed.value.status == 502
    assert (link.endings, link.cancels) == ([LeaseEnding.EOF], [])
    assert (link2.endings, link2.cancels) == ([LeaseEnding.REMOTE_ERROR], [])
    assert job2.outcome.error_code == "worker_died"


def test_frame_timeout_mid_stream_cancels_and_ends_the_stream():
    link = Link()
    job = started_job(link, messages.Token("j", "a"), frame_timeout_s=0.01)
    body = EventStreamBody(job, ResponseShaper("completion", "r", "m"))
    assert b'"text":"a"' in next(body)
    error = sse_error(next(body))
    assert (error["code"], error["status"], error["type"]) == (
        "timeout", 504, "server_error")
    assert link.endings == [LeaseEnding.TIMEOUT]
    assert [c.job_id for c in link.cancels] == ["j"]
    assert job.outcome.error_code == "timeout"
    with pytest.raises(StopIteration):
        next(body)
    body.close()  # gunicorn's close after the last event: nothing more to do
    assert len(link.cancels) == 1


def test_frame_timeout_without_a_stream_is_a_504_and_cancels():
    link = Link()
    job = started_job(link, messages.Token("j", "a"), frame_timeout_s=0.01)
    with pytest.raises(UpstreamError) as failed:
        collect(job)
    assert (failed.value.status, failed.value.body()["error"]["code"]) == (
        504, "timeout")
    assert link.endings == [LeaseEnding.TIMEOUT] and len(link.cancels) == 1


def test_exception_while_streaming_is_a_local_error_and_cancels():
    class BrokenShaper(ResponseShaper):
        def text_event(self, text: str, entries=(), timings=None) -> bytes:
            raise UnicodeEncodeError("utf-8", text, 0, 1, "test")

    link = Link()
    job = started_job(link, messages.Token("j", "a"))
    body = EventStreamBody(job, BrokenShaper("chat", "r", "m"))
    with pytest.raises(UnicodeEncodeError):
        next(body)
    assert link.endings == [LeaseEnding.LOCAL_ERROR]
    assert [c.job_id for c in link.cancels] == ["j"]


def test_first_frame_final_ends_the_lease_before_any_read():
    """``max_tokens: 0``: the job is over before the body exists; a client
    that leaves unread must not make the frontend cancel a finished job."""
    link = Link()
    job = started_job(link, messages.Final("j", "length", *NOTHING_USED))
    body = EventStreamBody(job, ResponseShaper("completion", "r", "m"))
    body.close()
    assert (link.endings, link.cancels) == ([LeaseEnding.EOF], [])


def test_refusal_and_answer_error_send_no_cancel():
    for answer, ending in [(messages.NoSlot("j", 2.0), LeaseEnding.REFUSED),
                           (messages.Error("j", ErrorCode.DUPLICATE_JOB, "dup"),
                            LeaseEnding.REMOTE_ERROR)]:
        link = Link()
        stream = JobStream("j")
        lease = SlotLease("j", link.send, link.forget, link.on_release)
        job = Job(lease, stream, send=link.send, frame_timeout_s=1,
                  credit_batch_frames=2, merge_frames_max=MERGE_FRAMES_MAX,
                  outcome=JobOutcome())
        stream.put(answer)
        assert job.answer(1.0) == answer
        assert (link.endings, link.cancels) == ([ending], [])


def test_lease_endings_know_which_side_ended_the_job():
    remote = {e for e in LeaseEnding if e.over_remotely}
    assert remote == {LeaseEnding.EOF, LeaseEnding.REMOTE_ERROR, LeaseEnding.REFUSED}
    # Metric and log labels from before the split keep their values.
    assert {e.value for e in LeaseEnding} >= {
        "eof", "error", "refused", "disconnect", "gc", "setup_failed"}
    with pytest.raises(TypeError):
        SlotLease("j", Link().send, Link().forget).release("error")


# --- frames waiting for a client that is behind -----------------------------------


def token(text: str, ids: list[int], with_logprobs: bool = True) -> messages.Token:
    """A TOKEN frame of ``ids`` (one log-probability entry each, if asked)."""
    return messages.Token(
        "j", text, n_tokens=len(ids), token_ids=messages.pack_token_ids(ids),
        logprobs=[TokenLogprob(i, b"x", -1.0) for i in ids] if with_logprobs else [])


def test_frames_waiting_behind_a_token_go_out_as_one():
    link = Link()
    final = messages.Final("j", "length", *NOTHING_USED)
    job = started_job(link, token("a", [1]), token("b", [2, 3]), token("c", [4]),
                      final)
    first = job.next_frame()
    assert (first.text, first.n_tokens) == ("abc", 4)
    assert messages.unpack_token_ids(first.token_ids) == [1, 2, 3, 4]
    assert [e.id for e in first.logprobs] == [1, 2, 3, 4]
    # The terminal frame waits for the next call: the job has not ended
    # before the text ahead of its end was handed out.
    assert not job.lease.released
    assert job.next_frame() == final
    assert link.endings == [LeaseEnding.EOF]
    # Credit counts frames, not events.
    link2 = Link()
    job2 = started_job(link2, *(token("t", [i]) for i in range(5)),
                       frame_timeout_s=0.05)
    assert job2.next_frame().n_tokens == 5
    with pytest.raises(UpstreamError):  # then the frame timeout: a 504
        collect(job2)
    assert sum(m.frames for m in link2.sent if isinstance(m, messages.Credit)) == 5


def test_at_most_merge_frames_max_go_out_as_one():
    frames = [token(str(i), [i]) for i in range(5)]
    job = started_job(Link(), *frames, messages.Final("j", "stop", *NOTHING_USED),
                      merge_frames_max=2)
    assert [job.next_frame().text for _ in range(3)] == ["01", "23", "4"]
    single = started_job(Link(), *frames, merge_frames_max=1)
    assert [single.next_frame().text for _ in range(5)] == ["0", "1", "2", "3", "4"]


def test_frames_that_do_not_match_or_carry_a_vector_stay_apart():
    vector = messages.Token("j", "", embedding=b"\0" * 16)
    job = started_job(Link(), token("a", [1]), token("b", [2], with_logprobs=False),
                      vector, vector)
    assert [job.next_frame().text for _ in range(2)] == ["a", "b"]
    assert [job.next_frame().embedding for _ in range(2)] == [b"\0" * 16] * 2


def test_a_merged_event_stays_bounded():
    half = "x" * (MERGED_TEXT_MAX_CHARS // 2)
    job = started_job(Link(), *(token(half, [i]) for i in range(3)))
    assert [len(job.next_frame().text) for _ in range(2)] == [
        MERGED_TEXT_MAX_CHARS, MERGED_TEXT_MAX_CHARS // 2]


# --- one error table ---------------------------------------------------------------


def test_every_domain_code_has_an_http_form():
    assert set(HTTP_FORMS) == set(ErrorCode)
    assert http_form("a_code_from_a_newer_peer") == http_form(ErrorCode.ENGINE_ERROR)


@pytest.mark.parametrize("code,status,kind", [
    (ErrorCode.CONTEXT_LENGTH_EXCEEDED, 400, "exceed_context_size_error"),
    (ErrorCode.CLIENT_STALLED, 408, "invalid_request_error"),
    (ErrorCode.WORKER_DIED, 502, "server_error"),
    (ErrorCode.WORKER_SHUTDOWN, 503, "unavailable_error"),
])
def test_sse_error_event_and_http_answer_agree(code, status, kind):
    """The same code gets the same type and status in both forms."""
    link = Link()
    job = started_job(link, messages.Token("j", "a"), messages.Error("j", code, "m"))
    body = EventStreamBody(job, ResponseShaper("chat", "r", "m"))
    next(body)
    event = sse_error(next(body))
    answer = UpstreamError(code, "m")
    assert (event["type"], event["status"], event["code"]) == (kind, status, code)
    assert (answer.status, answer.body()) == (
        status, {"error": {"message": "m", "type": kind, "code": code.value}})


def test_llama_cpp_shaped_503_bodies():
    assert Unavailable(ErrorCode.LOADING_MODEL, "Loading model").body() == {
        "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    refused = NoSlotAvailable(1.4)
    assert (refused.status, refused.headers(), refused.body()) == (
        503, {"Retry-After": "1"},
        {"error": {"code": 503, "message": "no slot available",
                   "type": "unavailable_error"}})


def test_error_frames_carry_no_status_on_the_wire():
    msg = messages.Error("j", ErrorCode.CLIENT_STALLED, "m")
    assert messages.decode(msg.to_wire()) == msg
    assert list(messages.Error.FIELD_TYPES) == ["job_id", "code", "message",
                                                "n_prompt_tokens", "n_ctx"]
    assert messages.PROTOCOL_HEADER == b"LLAMAPOOL09"
