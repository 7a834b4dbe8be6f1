"""A native crash in a worker, as llama.cpp's AMX kernel crashes (issue 27):
named in the log, retried once when it cost no output, held when it loops.

The crash is a real SIGSEGV, an invalid read in native code, made on demand
by ``LLAMAPOOL_TEST_CRASH`` (``workers.model.crash_on_demand``), through real
processes and the tiny model.
"""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from tests.pool import Pool, Proc, cli, free_port, wait_until

pytestmark = pytest.mark.stack

#: faulthandler's first line for a SIGSEGV, and what its stack shows.
FAULT = "Fatal Python error: Segmentation fault"


def full_log(proc: Proc) -> str:
    return proc.log_path.read_text(errors="replace")


def test_a_crash_at_every_warm_up_is_named_backed_off_and_held(tiny_model,
                                                                 tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "1",
                        "--port", str(port), "--threads", "1",
                        "--heartbeat-interval-s", "0.2"),
              tmp_path, env={**os.environ, "LLAMAPOOL_TEST_CRASH": "warm-up"})
    try:
        # 1 + 2 + 4 + 8 s of backoff between five crashes, then the hold.
        wait_until(lambda: "held after 5 crashes" in full_log(up), 90,
                   "the crash loop to be held")
        log = full_log(up)
        restarts = re.findall(r"worker-0 \(pid \d+\) killed by SIGSEGV during "
                              r"warm-up; restarting in (\d+)s", log)
        assert restarts == ["1", "2", "4", "8"], log[-3000:]
        assert re.search(r"worker-0 held after 5 crashes in a row; last: killed "
                         r"by SIGSEGV during warm-up \(pid \d+\)", log)
        # Every crash wrote the Python stack of every thread (faulthandler),
        # the warm-up on the main thread among them.
        assert log.count(FAULT) == 5
        assert "_load_and_warm_up" in log

        # /health says which worker and why, instead of "Loading model".
        def health_503():
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                return None
            # Not just "held": the crash before the hold says "(restart 4 of 4
            # before it is held)" until the held stand-in reports.
            return (r if r.status_code == 503 and "held after 5 crashes" in r.text
                    else None)

        r = wait_until(health_503, 30, "/health to say the worker is held")
        error = r.json()["error"]
        # llama.cpp's 503 body, as "Loading model" has it.
        assert (error["code"], error["type"]) == (503, "unavailable_error")
        assert error["message"].startswith("no worker can start: ")
        assert "worker-0 held after 5 crashes" in error["message"]
        assert "killed by SIGSEGV during warm-up" in error["message"]
        slots = httpx.get(url + "/slots", timeout=5).json()
        assert [s["state"] for s in slots] == ["failed"]
        assert "killed by SIGSEGV during warm-up" in slots[0]["failure"]
        # Held: the stand-in that says so runs instead, and crashes nothing.
        assert full_log(up).count(FAULT) == 5
    finally:
        up.stop()


@pytest.fixture
def once_pool(pool_factory, tmp_path):
    """Two workers; whichever gets the first job crashes on it, once."""
    flag = tmp_path / "crash-once"
    flag.write_text("")
    with pool_factory(workers=2, private=True,
                      worker_env={"LLAMAPOOL_TEST_CRASH": f"once:{flag}"}) as p:
        yield p


def dead_workers(pool: Pool) -> list[Proc]:
    return [w for w in pool.workers if not w.alive()]


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_crash_before_the_first_token_is_retried_on_another_worker(once_pool,
                                                                      stream):
    client = openai.OpenAI(base_url=once_pool.url + "/v1", api_key="unused",
                           max_retries=0)
    request = {"model": "tiny", "prompt": "Hello", "max_tokens": 5,
               "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(client.completions.create(stream=True, **request))
        assert chunks[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].text for c in chunks)
    else:
        out = client.completions.create(**request)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 5
        text = out.choices[0].text
    assert text
    # One worker died of it, with its stack in its log; the other answered.
    dead = wait_until(lambda: dead_workers(once_pool), 10, "the crashed worker")
    assert len(dead) == 1 and FAULT in full_log(dead[0])
    assert "_run_job" in full_log(dead[0])
    wait_until(lambda: once_pool.live_workers() == 1, 10,
               "the ledger to drop the dead worker")
    once_pool.wait_free(1)


def test_a_job_that_kills_two_workers_is_worker_crashed(tiny_model, tmp_path):
    """A poisoned request (every worker crashes on it) costs two workers,
    not the pool: the second death is ``worker_crashed``, and no third
    worker is tried."""
    p = Pool(tiny_model, tmp_path, workers=3,
             worker_env={"LLAMAPOOL_TEST_CRASH": "job"})
    try:
        r = httpx.post(p.url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 5}, timeout=60)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "worker_crashed"
        assert "retried" in error["message"]
        dead = wait_until(lambda: len(dead_workers(p)) == 2 and dead_workers(p),
                          10, "two dead workers")
        assert all(FAULT in full_log(w) for w in dead)
        wait_until(lambda: p.live_workers() == 1, 10, "one worker left")
        p.wait_free(1)
        assert len(dead_workers(p)) == 2  # the third was never given the job
    finally:
        p.stop()
