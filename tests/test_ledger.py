"""The broker's ledger: any order of events ends with every slot free."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from protocol import messages
from protocol.payloads import JobProgress
from workers.broker.ledger import IDLE, Ledger

TIMEOUT_S = 3.0


def ready(name: str) -> messages.Ready:
    return messages.Ready(name, "m", 512, 1, "h")


class LedgerMachine(RuleBasedStateMachine):
    jobs = Bundle("jobs")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(TIMEOUT_S)
        self.now = 0.0
        self.serial = 0

    def _tick(self) -> float:
        self.now += 0.1
        return self.now

    @rule(worker=st.sampled_from([b"w1", b"w2", b"w3"]))
    def worker_registers(self, worker):
        self.ledger.register_worker(worker, ready(worker.decode()), self._tick())

    @rule(worker=st.sampled_from([b"w1", b"w2", b"w3"]))
    def worker_dies(self, worker):
        self.ledger.remove_worker(worker)

    @rule(target=jobs, frontend=st.sampled_from([b"f1", b"f2"]))
    def submit(self, frontend):
        self.serial += 1
        job_id = f"j{self.serial}"
        self.ledger.register_frontend(frontend, self.now)
        slot = self.ledger.assign(job_id, frontend, self._tick())
        return job_id if slot is not None else "refused"

    @rule(job=jobs)
    def cancel(self, job):
        self.ledger.request_cancel(job, self._tick())

    @rule(job=jobs)
    def terminal_frame(self, job):
        self.ledger.finish(job, self._tick())

    @rule(frontend=st.sampled_from([b"f1", b"f2"]))
    def frontend_dies(self, frontend):
        for job in self.ledger.remove_frontend(frontend):
            self.ledger.request_cancel(job.job_id, self._tick())

    @rule()
    def time_passes_without_heartbeats(self):
        self.now += TIMEOUT_S + 1
        dead_workers, _ = self.ledger.expired(self.now)
        for worker in dead_workers:
            self.ledger.remove_worker(worker)

    @invariant()
    def books_balance(self):
        busy = [w for w in self.ledger.workers.values() if w.state != IDLE]
        assert len(busy) == len(self.ledger.jobs)
        for w in busy:
            assert self.ledger.jobs[w.job_id].worker == w.identity
        assert self.ledger.free_slots() + len(busy) == self.ledger.live_slots()
        assert 1 <= self.ledger.retry_after_s(self.now) <= 60

    def teardown(self):
        # Every job's terminal frame eventually passes (or its worker dies):
        # then every live slot is free.
        for job_id in list(self.ledger.jobs):
            self.ledger.finish(job_id, self._tick())
        assert self.ledger.free_slots() == self.ledger.live_slots()


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_retry_after_comes_from_live_progress():
    ledger = Ledger(TIMEOUT_S)
    ledger.register_worker(b"w", ready("w"), 0)
    slot = ledger.assign("j", b"f", 0)
    slot.progress = JobProgress("j", n_generated=10, max_tokens=110,
                                tokens_per_s=20.0)
    assert ledger.retry_after_s(0) == 5.0  # 100 tokens left at 20/s


def test_retry_after_counts_a_paused_slot_as_its_stall_time_left():
    """A slot paused for lack of credit frees when its stall timeout ends it,
    whatever speed it had; estimates count down from their heartbeat."""
    ledger = Ledger(TIMEOUT_S)
    for name in (b"a", b"b"):
        ledger.register_worker(name, ready(name.decode()), 0)
        ledger.assign(name.decode(), b"f", 0)
    fast_then_paused = JobProgress("a", n_generated=10, max_tokens=110,
                                   tokens_per_s=1000.0, pause_ends_in_s=40.0)
    ledger.record_progress(ledger.workers[b"a"], fast_then_paused, 10.0)
    ledger.record_progress(ledger.workers[b"b"], dataclasses.replace(
        fast_then_paused, job_id="b", pause_ends_in_s=50.0), 10.0)
    assert ledger.retry_after_s(10.0) == 40.0
    assert ledger.retry_after_s(25.5) == 25.0  # 40 s from t=10, rounded up
    assert ledger.retry_after_s(100.0) == 1.0  # overdue: the minimum
    # One generating slot near its end sets the hint.
    ledger.record_progress(ledger.workers[b"b"], dataclasses.replace(
        fast_then_paused, job_id="b", pause_ends_in_s=None,
        tokens_per_s=20.0), 25.5)
    assert ledger.retry_after_s(25.5) == 5.0
    # A cancelling slot is about to be free.
    ledger.request_cancel("a", 26.0)
    assert ledger.retry_after_s(26.0) == 1.0


def test_least_recently_used_idle_worker_gets_the_job():
    ledger = Ledger(TIMEOUT_S)
    ledger.register_worker(b"a", ready("a"), 0)
    ledger.register_worker(b"b", ready("b"), 1)
    assert ledger.assign("j1", b"f", 2).identity == b"a"
    ledger.finish("j1", 3)
    assert ledger.assign("j2", b"f", 4).identity == b"b"


def test_the_worker_holding_the_prefix_wins_over_lru():
    ledger = Ledger(TIMEOUT_S)
    ledger.register_worker(b"a", ready("a"), 0)
    ledger.register_worker(b"b", ready("b"), 1)
    assert ledger.assign("j1", b"f", 2, [11, 12, 13]).identity == b"a"
    assert ledger.assign("j2", b"f", 3, [21, 22]).identity == b"b"
    ledger.finish("j1", 4)
    ledger.finish("j2", 5)
    # LRU would pick "a"; "b" holds the first two blocks of this prompt.
    slot = ledger.assign("j3", b"f", 6, [21, 22, 99])
    assert slot.identity == b"b" and slot.shared_blocks_at_assign == 2
