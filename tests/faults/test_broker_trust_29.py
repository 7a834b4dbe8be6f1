"""What the broker takes on trust, and what it says (issue 29, items 5, 7, 8),
through a real broker, real workers on the tiny model, and peers that lie.

* Item 5: a worker that claims prompts it does not hold attracted every job
  (40 of 40); now its claims are checked against the ``cached_tokens`` of
  the jobs they won, and after one failed claim they steer nothing.
* Item 7: a SUBMIT that does not decode (an unknown chat role, an 8 MB body)
  was dropped in silence, by the worker and by the broker, and its sender
  waited out a timeout (30 s for the broker, 5 s for a frontend); now each
  answers ERROR ``unreadable_job`` when the job id can be read.
* Item 8: a worker that dies during a job: the broker's log line names the
  job, its request id and its key (the last 4 characters).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

import httpx
import msgpack
import pytest
import zmq

from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import ChatMessage, GenerationRequest, Timings, Usage
from protocol.prefix import BLOCK_TOKENS, prefix_blocks
from protocol.prompt_cache import PromptCacheStatus
from tests.faults.conftest import figures
from tests.pool import TEST_HEARTBEAT, BrokerProbe, Pool, Proc, cli, wait_until

pytestmark = pytest.mark.stack

N_PROMPTS = 40


def full_log(proc: Proc) -> str:
    return proc.log_path.read_text(errors="replace")


class Peer:
    """A DEALER speaking the wire protocol, read frame by frame."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg_or_frames) -> None:
        self.sock.send_multipart(msg_or_frames if isinstance(msg_or_frames, list)
                                 else msg_or_frames.to_wire())

    def next(self, timeout_s: float, job_id: str) -> messages.Message | None:
        """The next message about ``job_id``, or None in time."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                return None
            msg = messages.decode(self.sock.recv_multipart())
            if getattr(msg, "job_id", None) == job_id:
                return msg
        return None

    def terminal(self, timeout_s: float, job_id: str) -> messages.Message | None:
        """ACCEPTED skipped, TOKENs skipped: the job's FINAL or ERROR."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.next(left, job_id)
            if msg is None or isinstance(msg, (*messages.TERMINAL, messages.NoSlot)):
                return msg
        return None


class LyingWorker(threading.Thread):
    """Registers, claims the fingerprints of prompts it never saw, and ends
    every job it gets with a FINAL at once (reusing, truthfully, nothing)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, model: str,
                 claims: list[list[int]]) -> None:
        super().__init__(daemon=True)
        self.peer = Peer(ctx, endpoint)
        self.model = model
        self.claims = claims
        self.jobs: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        peer = self.peer
        # In this order on one pipe: the broker knows the worker (READY)
        # before it reads the report, and keeps it.
        peer.send(messages.Ready("liar", self.model, 512, 1, "liar-host"))
        peer.send(messages.CacheReport(self.claims, PromptCacheStatus()))
        beat = messages.Heartbeat().to_wire()
        while not self.stop.is_set():
            peer.sock.send_multipart(beat)
            if not peer.sock.poll(100):
                continue
            while peer.sock.poll(0):
                msg = messages.decode(peer.sock.recv_multipart())
                if isinstance(msg, messages.Submit):
                    self.jobs.append(msg.job_id)
                    n = len(msg.request.prompt_tokens or [])
                    peer.send(messages.Final(
                        msg.job_id, "length", Usage(n, 1, n + 1, cached_tokens=0),
                        Timings(n, 1.0, 1, 1.0)))


def prompt(i: int) -> list[int]:
    """Four blocks of byte-token ids, unlike every other prompt's from the
    first token on (37 and 240 are coprime)."""
    return [10 + (i * 37 + j * 11) % 240 for j in range(4 * BLOCK_TOKENS)]


def follow_up(i: int) -> list[int]:
    """The prompt and one block more: the conversation's next turn."""
    return prompt(i) + [10 + (i * 13 + j * 7 + 5) % 240 for j in range(BLOCK_TOKENS)]


def run_job(frontend: Peer, tokens: list[int]) -> tuple[int, messages.Message]:
    job_id = uuid.uuid4().hex
    frontend.send(messages.Submit(
        job_id, GenerationRequest("completion", prompt_tokens=tokens, max_tokens=1),
        prefix_blocks(tokens)))
    accepted = frontend.next(10, job_id)
    assert isinstance(accepted, messages.Accepted), accepted
    end = frontend.terminal(30, job_id)
    assert isinstance(end, messages.Final), end
    return accepted.slot_id, end


def test_a_worker_whose_cache_claims_fail_stops_attracting_jobs(tiny_model, tmp_path):
    """A real worker serves 40 conversations; then a liar joins, claiming
    every conversation's next turn (one block more than the real worker
    holds). Before: the liar got 40 of 40 follow-ups. Now: 1, the one whose
    FINAL showed the claim false; the real worker, whose claims hold (it
    reuses 4 blocks of each), gets the other 39."""
    fig = figures("29.5 lying cache claims")
    pool_dir = tmp_path
    frontends, workers = f"ipc://{pool_dir}/frontends", f"ipc://{pool_dir}/workers"
    broker = Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                                workers, *TEST_HEARTBEAT), pool_dir)
    worker = Proc("worker", cli("worker", "--broker", workers, "--model",
                                str(tiny_model), "--threads", "1", "--ctx", "512",
                                *TEST_HEARTBEAT), pool_dir)
    ctx = zmq.Context()
    probe = BrokerProbe(frontends, ctx=ctx)
    liar = None
    try:
        snap = wait_until(lambda: (s := probe.status(timeout_s=1.0))
                          and s["slots_free"] == 1 and s, 60, "the worker")
        model = snap["slots"][0]["model"]
        frontend = Peer(ctx, frontends)
        frontend.send(messages.Hello(os.getpid(), "test"))
        for i in range(N_PROMPTS):  # the conversations' first turns
            run_job(frontend, prompt(i))

        liar = LyingWorker(ctx, workers, model,
                           [prefix_blocks(follow_up(i)) for i in range(N_PROMPTS)])
        liar.start()
        wait_until(lambda: probe.status()["slots_free"] == 2, 10, "the liar to join")
        slot_of = {s["worker_name"]: s["id"] for s in probe.status()["slots"]}
        reused = []
        for i in range(N_PROMPTS):
            slot_id, final = run_job(frontend, follow_up(i))
            if slot_id != slot_of["liar"]:
                reused.append(final.usage.cached_tokens)
        snap = probe.status()
        counters = snap["counters"]
        fig.faults = N_PROMPTS
        fig.notes = (f"liar got {len(liar.jobs)} of {N_PROMPTS} follow-ups "
                     f"(before the check: {N_PROMPTS} of {N_PROMPTS})")
        print(f"\n{fig.notes}; the real worker reused {min(reused, default=0)}"
              f"-{max(reused, default=0)} tokens of each")
        assert len(liar.jobs) == 1, (len(liar.jobs), counters)
        assert counters["cache_claims_failed"] == 1
        assert counters["workers_distrusted"] == 1
        # The real worker's claims hold: it reused what it said it had.
        assert len(reused) == N_PROMPTS - 1
        assert min(reused) >= 3 * BLOCK_TOKENS, reused
        assert counters["cache_claims_kept"] >= N_PROMPTS - 1
        assert "worker's cache claims failed: slot=1" in full_log(broker)
    finally:
        if liar is not None:
            liar.stop.set()
            liar.join(timeout=5)
        probe.close()
        ctx.destroy(linger=0)
        worker.stop()
        broker.stop()


def unknown_role_submit(job_id: str) -> list[bytes]:
    """A chat SUBMIT whose one turn has a role this version does not know
    (as a newer peer's would be)."""
    body = messages.Submit(job_id, GenerationRequest(
        "chat", messages=[ChatMessage("user", "hi")], max_tokens=2)).to_body()
    body[1][2][0][0] = "wizard"
    return [messages.PROTOCOL_HEADER, messages.Submit.COMMAND, msgpack.packb(body)]


def test_an_unreadable_submit_is_answered_by_the_worker(tiny_model, tmp_path):
    """A broker (of another version, or one that lies) sends a real worker
    SUBMITs it cannot decode: each gets ERROR ``unreadable_job`` at once,
    where before nothing came back (the broker waited 30 s), and the worker
    still serves the next, good job."""
    fig = figures("29.7 unreadable SUBMIT, worker side")
    endpoint = f"ipc://{tmp_path}/fake-broker"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    worker = Proc("worker", cli("worker", "--broker", endpoint, "--model",
                                str(tiny_model), "--threads", "1", "--ctx", "512",
                                "--heartbeat-interval-s", "0.2",
                                "--heartbeat-liveness", "10"), tmp_path)
    beat = messages.Heartbeat().to_wire()
    identity = None

    def until(wanted, timeout_s: float):
        """Serve as a broker (heartbeats) until ``wanted(msg)`` is truthy."""
        nonlocal identity
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if identity is not None:
                router.send_multipart([identity, *beat])
            if not router.poll(100):
                continue
            ident, *frames = router.recv_multipart()
            msg = messages.decode(frames)
            if isinstance(msg, messages.Ready):
                identity = ident
            if wanted(msg):
                return msg
        return None

    try:
        assert until(lambda m: isinstance(m, messages.Ready), 60), worker.log()
        role_job, big_job = uuid.uuid4().hex, uuid.uuid4().hex
        bad = {"unknown chat role": (role_job, unknown_role_submit(role_job)),
               "8 MB body": (big_job, messages.Submit(big_job, GenerationRequest(
                   "completion", "x" * 8_000_000)).to_wire())}
        answered_s = []
        for why, (job_id, frames) in bad.items():
            sent_at = time.monotonic()
            router.send_multipart([identity, *frames])
            answer = until(lambda m, j=job_id: getattr(m, "job_id", None) == j, 5)
            assert isinstance(answer, messages.Error), (why, answer, worker.log())
            assert answer.code == ErrorCode.UNREADABLE_JOB, answer
            fig.faults += 1
            answered_s.append(time.monotonic() - sent_at)
        good = uuid.uuid4().hex
        router.send_multipart([identity, *messages.Submit(good, GenerationRequest(
            "completion", "Hi", max_tokens=2)).to_wire()])
        end = until(lambda m: isinstance(m, messages.TERMINAL) and m.job_id == good,
                    30)
        assert isinstance(end, messages.Final), end
        fig.notes = (f"ERROR unreadable_job in <= {max(answered_s) * 1000:.0f} ms "
                     "(before: nothing; the broker waits 30 s)")
    finally:
        worker.stop()
        ctx.destroy(linger=0)


def test_an_unreadable_submit_is_answered_by_the_broker(tmp_path):
    """A frontend of a newer version (a chat role this broker does not know)
    gets ERROR ``unreadable_job`` for its SUBMIT, where before the broker
    dropped it and the frontend waited out its 5 s submit timeout."""
    frontends, workers = f"ipc://{tmp_path}/frontends", f"ipc://{tmp_path}/workers"
    broker = Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                                workers, *TEST_HEARTBEAT), tmp_path)
    ctx = zmq.Context()
    try:
        frontend = Peer(ctx, frontends)
        frontend.send(messages.Hello(os.getpid(), "newer"))
        job_id = uuid.uuid4().hex
        frontend.send(unknown_role_submit(job_id))
        answer = frontend.next(3, job_id)
        assert isinstance(answer, messages.Error), (answer, broker.log())
        assert answer.code == ErrorCode.UNREADABLE_JOB
        assert "wizard" in answer.message
        probe = BrokerProbe(frontends, ctx=ctx)
        counters = probe.status()["counters"]
        probe.close()
        assert counters["unreadable_submits"] == 1
        assert counters["malformed_dropped"] == 1
    finally:
        ctx.destroy(linger=0)
        broker.stop()


def test_the_broker_log_names_the_job_and_key_a_worker_died_during(tiny_model,
                                                                   tmp_path):
    """Through the real frontend: the request's id and its key's last four
    characters travel with SUBMIT, and the broker's line about the death
    names them with the job (before: only the slot, pid and host)."""
    key = "sk-test-crash-29ab"
    pool = Pool(tiny_model, tmp_path, workers=1, api_keys=(key,),
                worker_env={"LLAMAPOOL_TEST_CRASH": "job"})
    try:
        r = httpx.post(pool.url + "/v1/completions", timeout=30,
                       headers={"Authorization": f"Bearer {key}",
                                "X-Request-Id": "req-29-death"},
                       json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 502, r.text
        line = wait_until(lambda: re.search(
            r"worker lost \([^)]*\) during job (\w+) \(request req-29-death, key "
            r"29ab\): slot=0 pid=\d+ host=\S+; the job fails with worker_died",
            full_log(pool.broker)), 10, "the broker's line about the death")
        assert len(line[1]) == 32  # the job id, as the frontend made it
        assert key not in full_log(pool.broker)
    finally:
        pool.stop()
