"""Unit tests for the broker's held SUBMITs (``workers.broker.step_down``)."""

from __future__ import annotations

from protocol import messages
from protocol.payloads import GenerationRequest
from workers.broker.step_down import HeldSubmits, Told
from workers.model.active_job import ActiveJob, ThreadBudget
from workers.model.settings import WorkerSettings

A, B, C = b"worker-a", b"worker-b", b"worker-c"


def held_one(waiting_on=None) -> HeldSubmits:
    held = HeldSubmits()
    held.hold("job", C, [b"submit"], waiting_on or {A: Told(1, 1)}, deadline=10.0)
    return held


def test_goes_when_the_running_worker_confirms_its_step_down():
    held = held_one()
    assert [h.job_id for h in held.stepped_down(A, 1, 1)] == ["job"]
    assert len(held) == 0


def test_a_count_above_the_one_told_is_not_a_step_down():
    held = held_one()
    assert held.stepped_down(A, 2, 1) == []
    assert len(held) == 1


def test_a_late_answer_to_an_older_threads_releases_nothing():
    """THREADS 1 (seq 3), THREADS 2 (seq 4), THREADS 1 (seq 5): the worker's
    answer to seq 3 may arrive after seq 5 was sent, while the worker decodes
    with the two threads of seq 4. It must not release a hold made by seq 5."""
    held = held_one({A: Told(1, 5)})
    assert held.stepped_down(A, 1, 3) == []
    assert held.stepped_down(A, 2, 4) == []
    assert len(held) == 1
    assert [h.job_id for h in held.stepped_down(A, 1, 5)] == ["job"]


def test_an_answer_to_a_newer_threads_with_no_more_threads_releases():
    held = held_one({A: Told(1, 5)})
    assert [h.job_id for h in held.stepped_down(A, 1, 6)] == ["job"]


def test_waits_for_every_worker_it_waits_on():
    held = held_one({A: Told(1, 1), B: Told(1, 1)})
    assert held.stepped_down(A, 1, 1) == []
    assert held.stepped_down(C, 1, 1) == []  # not one it waits on
    assert [h.job_id for h in held.stepped_down(B, 1, 1)] == ["job"]


def test_a_worker_whose_job_ended_or_that_died_is_not_waited_on():
    held = held_one({A: Told(1, 1), B: Told(1, 1)})
    held.worker_idle(A)
    assert [h.frames for h in held.worker_idle(B)] == [[b"submit"]]


def test_the_wait_is_bounded():
    held = held_one()
    assert held.next_deadline() == 10.0
    assert held.due(9.99) == []
    assert [h.job_id for h in held.due(10.0)] == ["job"]
    assert held.next_deadline() is None
    assert held.stepped_down(A, 1, 1) == []  # sent once only


def test_a_cancelled_job_is_released_at_once_and_once_only():
    held = held_one()
    assert held.release("job").worker == C
    assert held.release("job") is None
    assert held.stepped_down(A, 1, 1) == []


def running_job(wanted) -> tuple[ActiveJob, list[messages.Message]]:
    """A job whose thread budget is ``wanted()``, and what it sends."""
    sent: list[messages.Message] = []
    job = ActiveJob(
        messages.Submit("j", GenerationRequest(kind="completion", prompt="x")),
        sent.append, WorkerSettings(broker_endpoint="tcp://127.0.0.1:1"), wanted)
    return job, sent


def test_a_running_job_confirms_each_new_budget_once():
    """The worker's side: the decode loop confirms a budget when it takes it
    in force (the broker may be holding a SUBMIT for it), once per THREADS."""
    budget = [ThreadBudget(2, 0.0, 0)]
    job, sent = running_job(lambda: budget[0])
    assert job.threads_to_use(2) == 2
    budget[0] = ThreadBudget(1, 1.0, 1)  # THREADS 1 arrived
    assert job.threads_to_use(2) == 1
    assert job.threads_to_use(1) == 1
    confirmed = [m.n_threads for m in sent if isinstance(m, messages.ThreadsSet)]
    assert confirmed == [2, 1]


def test_a_budget_at_or_above_the_running_count_is_in_force_at_once():
    """A survivor at one thread told two, then one again before its next
    token (the next job landed meanwhile), never decoded with two: the link
    confirms the one at once instead of holding the new job for a token."""
    budget = [ThreadBudget(1, 0.0, 0)]
    job, _ = running_job(lambda: budget[0])
    assert job.threads_to_use(1) == 1  # decoding with one
    budget[0] = ThreadBudget(2, 1.0, 1)  # THREADS 2 stored, not yet taken
    assert job.in_force_at_once(2)
    budget[0] = ThreadBudget(1, 1.1, 2)  # THREADS 1 before its next token
    assert job.in_force_at_once(1)


def test_a_step_down_from_the_running_count_waits_for_the_decode_loop():
    budget = [ThreadBudget(2, 0.0, 0)]
    job, sent = running_job(lambda: budget[0])
    assert job.threads_to_use(2) == 2  # decoding with two
    budget[0] = ThreadBudget(1, 1.0, 1)
    assert not job.in_force_at_once(1)
    assert job.threads_to_use(2) == 1  # its next token takes it
    assert [m.n_threads for m in sent if isinstance(m, messages.ThreadsSet)] == [2, 1]


def test_a_budget_stored_while_the_count_is_chosen_is_taken_not_confirmed_early():
    """The link stores THREADS 1 between the decode loop's read of THREADS 2
    and its second read: the loop takes the one, and confirms only that."""
    reads = iter([ThreadBudget(2, 0.0, 1), ThreadBudget(1, 0.1, 2)])
    latest = [None]

    def wanted():
        latest[0] = next(reads, latest[0])
        return latest[0]

    job, sent = running_job(wanted)
    assert job.threads_to_use(1) == 1
    assert not job.in_force_at_once(0)
    assert job.in_force_at_once(1)
    assert [m.n_threads for m in sent if isinstance(m, messages.ThreadsSet)] == [1]


def test_the_confirmation_names_the_threads_it_answers():
    """THREADS_SET echoes the broker's sequence number of the budget taken,
    so that the broker can tell a late answer from the one it waits for."""
    budget = [ThreadBudget(2, 0.0, 0, broker_seq=6)]
    job, sent = running_job(lambda: budget[0])
    assert job.threads_to_use(2) == 2
    budget[0] = ThreadBudget(1, 1.0, 1, broker_seq=7)
    assert job.threads_to_use(2) == 1
    assert [(m.n_threads, m.seq) for m in sent
            if isinstance(m, messages.ThreadsSet)] == [(2, 6), (1, 7)]
