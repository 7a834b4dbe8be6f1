"""``--threads auto`` through real processes: a running job's worker steps
down when a second job lands on its host and back up when that job ends, and
greedy output is the same as when the thread count never changed.

The test speaks to the broker as a frontend does (a DEALER), so that it
decides when each job may go on: workers run with a credit window of a few
frames, and a job waits for the test's CREDIT between steps. Nothing is
timed; each step waits on what the broker's ledger (STATUS) or ``/slots``
shows.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import zmq

from protocol import messages
from protocol.payloads import GenerationRequest, Sampling
from tests.pool import EXACT_GREEDY, Pool, wait_until
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

WINDOW = 4  # frames a job may send before it waits for CREDIT
N_TOKENS = 40
GREEDY = GenerationRequest(
    kind="completion", prompt="Once upon a time", max_tokens=N_TOKENS,
    sampling=Sampling(temperature=0.0, top_k=1, seed=1, ignore_eos=True),
)


# A wait far beyond any load: a missing step-down confirmation shows as
# an expired wait, not as a slow test. The credit window is a worker
# variable (there is no flag for it).
auto_pool = pool_fixture(workers=2,
                         worker_args=("--threads", "auto", "--pool-cores", "2",
                                      *EXACT_GREEDY),
                         worker_env={"LLAMAPOOL_CREDIT_WINDOW_FRAMES": str(WINDOW)},
                         broker_args=("--step-down-wait-s", "10"))


class RawFrontend:
    """A frontend DEALER that grants credit only when told to."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart(messages.Hello(os.getpid(), "test").to_wire())
        self.text: dict[str, str] = {}
        self.frames: dict[str, int] = {}
        self.ended: dict[str, messages.Message] = {}

    def submit(self, job_id: str) -> None:
        self.text[job_id], self.frames[job_id] = "", 0
        self.sock.send_multipart(messages.Submit(job_id, GREEDY).to_wire())

    def credit(self, job_id: str, frames: int) -> None:
        self.sock.send_multipart(messages.Credit(job_id, frames).to_wire())

    def pump(self, timeout_s: float = 0.05) -> None:
        """Read whatever arrived, after a heartbeat: the broker cancels the
        jobs of a frontend it has not heard from for its liveness window."""
        self.sock.send_multipart(messages.Heartbeat().to_wire())
        while self.sock.poll(timeout_s * 1000):
            msg = messages.decode(self.sock.recv_multipart())
            if isinstance(msg, messages.Token):
                self.text[msg.job_id] += msg.text
                self.frames[msg.job_id] += 1
            elif isinstance(msg, (messages.Final, messages.Error)):
                self.ended[msg.job_id] = msg
                if isinstance(msg, messages.Final):
                    self.text[msg.job_id] += msg.text
            timeout_s = 0

    def wait_frames(self, job_id: str, n: int) -> None:
        def arrived():
            self.pump()
            return self.frames[job_id] >= n or job_id in self.ended
        wait_until(arrived, 60, f"{n} frames of {job_id}")

    def run_to_end(self, job_id: str) -> str:
        self.credit(job_id, N_TOKENS * 2)

        def ended():
            self.pump()
            return job_id in self.ended
        wait_until(ended, 60, f"the end of {job_id}")
        final = self.ended[job_id]
        assert isinstance(final, messages.Final), final
        assert final.finish_reason == "length", final
        return self.text[job_id]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def threads_of(pool: Pool, job_id: str) -> int | None:
    for slot in pool.status()["slots"]:
        progress = slot.get("progress")
        if slot["id_task"] == job_id and progress:
            return progress["n_threads"]
    return None


def wait_threads(pool: Pool, fe: RawFrontend, job_id: str, n: int) -> None:
    def decoding_with_n():
        fe.pump(0)  # keeps the test's frontend alive in the broker's eyes
        return threads_of(pool, job_id) == n
    wait_until(decoding_with_n, 60,
               f"{job_id} to decode with {n} threads; {pool.logs()[-3000:]}")


def slots_page(pool: Pool) -> list[dict]:
    with urllib.request.urlopen(pool.url + "/slots", timeout=10) as r:
        return json.loads(r.read())


def test_a_running_job_steps_down_and_up_and_greedy_output_is_unchanged(auto_pool):
    pool = auto_pool
    pool.assert_whole()
    fe = RawFrontend(pool.frontends_ep)
    try:
        # The reference: a lone job, two threads from start to end.
        fe.submit("ref")
        fe.wait_frames("ref", WINDOW)
        wait_threads(pool, fe, "ref", 2)
        reference = fe.run_to_end("ref")
        pool.assert_whole()

        # A starts alone: two threads.
        fe.submit("A")
        fe.wait_frames("A", WINDOW)
        wait_threads(pool, fe, "A", 2)
        # B lands on the same host: A decodes its next tokens with one.
        fe.submit("B")
        def both_busy():
            fe.pump(0)
            return len([s for s in pool.status()["slots"]
                        if s["state"] == "busy"]) == 2
        wait_until(both_busy, 60, "both slots busy")
        # B's SUBMIT waited for A's confirmation (A, paused for credit, gave
        # it at once), not for the wait to run out.
        def b_sent():
            fe.pump(0)
            return pool.status()["counters"]["submits_held_for_step_down"] == 1
        wait_until(b_sent, 60, "B held for A's step-down")
        fe.wait_frames("B", 1)
        assert pool.status()["counters"]["step_down_waits_expired"] == 0
        fe.credit("A", WINDOW)
        fe.wait_frames("A", 2 * WINDOW)
        wait_threads(pool, fe, "A", 1)
        # /slots shows it too.
        shown = {s["id_task"]: s["n_threads"] for s in slots_page(pool)}
        assert shown["A"] == 1, shown
        assert fe.frames["A"] < N_TOKENS, "A must still be running"
        # B ends: A steps back up for its next tokens.
        fe.run_to_end("B")
        fe.credit("A", WINDOW)
        fe.wait_frames("A", 3 * WINDOW)
        wait_threads(pool, fe, "A", 2)
        assert fe.frames["A"] < N_TOKENS, "A must still be running"
        changed = fe.run_to_end("A")
        assert reference and changed == reference
        pool.assert_whole()
    finally:
        fe.close()

