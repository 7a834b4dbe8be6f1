"""Graceful shutdown: SIGTERM finishes or ends work cleanly; a second one is
immediate; nobody prints a traceback."""

from __future__ import annotations

import contextlib
import json
import signal

import httpx
import pytest

from llamapool.signals import EXIT_FORCED
from tests.pool import wait_until
from tests.test_slot_paths import hold_slot

pytestmark = pytest.mark.stack


def events(data: bytes) -> list[str]:
    return [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]


@pytest.fixture
def make_pool(pool_factory):
    """Private pools: every test here stops (part of) its pool."""
    with contextlib.ExitStack() as pools:
        yield lambda **kw: pools.enter_context(pool_factory(private=True, **kw))


def test_idle_worker_leaves_the_ledger_on_sigterm(make_pool):
    pool = make_pool(workers=2)
    worker = pool.workers[0]
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(timeout=10) == 0
    pool.wait_free(1)
    assert pool.status()["counters"].get("worker_deaths", 0) == 0  # a goodbye
    assert "Traceback" not in worker.log()


def test_busy_worker_finishes_its_job_within_the_grace_period(make_pool):
    pool = make_pool(workers=1)
    stream, _ = hold_slot(pool)
    worker = pool.workers[0]
    worker.popen.send_signal(signal.SIGTERM)
    # It takes no new job meanwhile.
    wait_until(lambda: pool.status()["slots_free"] == 0, 5, "draining")
    r = httpx.post(pool.url + "/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503
    data = stream.read_to_end()
    stream.close()
    assert events(data)[-1] == "[DONE]"
    assert json.loads(events(data)[-2])["choices"][0]["finish_reason"] == "length"
    assert worker.popen.wait(timeout=10) == 0
    pool.wait_free(0)


def test_grace_period_over_ends_the_job_with_a_clear_error(make_pool):
    pool = make_pool(workers=1, worker_args=("--shutdown-grace-s", "0.5"))
    stream, _ = hold_slot(pool)
    worker = pool.workers[0]
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(timeout=10) == 0
    data = stream.read_to_end()
    stream.close()
    last = json.loads(events(data)[-1])
    assert last["error"]["code"] == "worker_shutdown"
    assert "[DONE]" not in events(data)
    pool.wait_free(0)


def test_second_sigterm_exits_at_once(make_pool):
    pool = make_pool(workers=1)
    stream, _ = hold_slot(pool)
    worker = pool.workers[0]
    worker.popen.send_signal(signal.SIGTERM)
    wait_until(lambda: pool.status()["slots"][0].get("state") == "busy"
               and pool.status()["slots_free"] == 0, 30, "draining")
    worker.popen.send_signal(signal.SIGTERM)
    # The exit code proves the second signal did it (the grace period would
    # end differently); the generous deadline only guards against a hang on
    # a loaded machine, where 5 s was not always enough to be scheduled.
    assert worker.popen.wait(timeout=60) == EXIT_FORCED
    stream.close()


def test_broker_and_frontend_exit_cleanly(make_pool):
    pool = make_pool(workers=1)
    httpx.post(pool.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    pool.probe.close()
    assert pool.frontend.stop() == 0
    assert pool.broker.stop() == 0
    for proc in (pool.frontend, pool.broker):
        assert "Traceback" not in proc.log(), proc.log()
    # The worker notices the broker is gone and keeps trying; SIGTERM ends it.
    assert pool.workers[0].stop() == 0


def test_sigusr1_writes_the_threads_stacks_and_the_process_goes_on(make_pool):
    # For a broker or worker that seems stuck (tests/pool.py asks one that
    # hangs on SIGTERM, before killing it).
    pool = make_pool(workers=1)
    for proc in (pool.broker, pool.workers[0]):
        proc.popen.send_signal(signal.SIGUSR1)
        wait_until(lambda proc=proc: "most recent call first" in proc.log(), 30,
                   f"{proc.name}'s stacks in its log")
        assert proc.alive()
    # Still serving, and still stopping cleanly.
    r = httpx.post(pool.url + "/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert pool.workers[0].stop() == 0
    assert pool.broker.stop() == 0
