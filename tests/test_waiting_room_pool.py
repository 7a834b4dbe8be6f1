"""A bounded, fair wait for a slot (issue 31, items 1-4 and 6), through real
gunicorn, a real broker and one worker on the tiny GGUF.

Before, a full pool answered 503 at once whatever the broker was told (it
had no ``--queue-max``), which fails most requests of a load test. Now a
broker with a queue lets a job wait, bounded by count, prompt tokens and a
deadline (the request's ``X-Max-Wait-S`` may shorten it); a waiter whose
client leaves is gone and nothing runs for it; a freed slot goes to the key
served least lately; ``llamacpp:requests_deferred`` counts the waiters.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest

from tests.pool import scrape_metrics, wait_until
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import LONG, RawStream, hold_slot

pytestmark = pytest.mark.stack

KEY_A, KEY_B = "sk-queue-a", "sk-queue-b"
TIMEOUT_S = 120

#: One slot, up to 8 waiters for 60 s: fairness and the waits that end well.
queued_pool = pool_fixture(workers=1, api_keys=(KEY_A, KEY_B),
                           broker_args=("--queue-max", "8", "--queue-timeout-s", "60"))
#: The frontend waits 1 s for a broker's answer: a QUEUED must extend it.
short_answer_pool = pool_fixture(
    workers=1, api_keys=(KEY_A, KEY_B), frontend_env={"LLAMAPOOL_SUBMIT_TIMEOUT_S": "1"},
    broker_args=("--queue-max", "8", "--queue-timeout-s", "60"))
#: One waiter at most, of 60 prompt tokens at most.
tight_pool = pool_fixture(workers=1, api_keys=(KEY_A, KEY_B), broker_args=(
    "--queue-max", "1", "--queue-max-tokens", "60", "--queue-timeout-s", "60"))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def scrape(pool) -> dict:
    return scrape_metrics(pool.url, auth(KEY_A), TIMEOUT_S)


#: The pool's one model, the ``model`` label of its series (issue 30).
MODEL = "tiny.gguf"


def metric(pool, name: str, **labels) -> float:
    return scrape(pool).get((name, tuple(sorted(labels.items()))), 0.0)


def waiting(pool) -> int:
    return int(metric(pool, "llamacpp:requests_deferred", model=MODEL))


def complete(pool, key: str, prompt: str = "Hi", headers: dict | None = None):
    return httpx.post(pool.url + "/v1/completions", timeout=TIMEOUT_S,
                      headers={**auth(key), **(headers or {})},
                      json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})


@pytest.fixture
def clients():
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        yield pool


def test_a_waiter_gets_the_slot_when_it_frees(queued_pool, clients):
    def waits() -> tuple[float, float]:
        return (metric(queued_pool, "llamapool_queue_wait_seconds_count", model=MODEL),
                metric(queued_pool, "llamapool_queue_wait_seconds_sum", model=MODEL))
    count_before, sum_before = waits()
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    submitted = time.monotonic()
    waiter = clients.submit(complete, queued_pool, KEY_B)
    wait_until(lambda: waiting(queued_pool) == 1, 30, "the request to wait")
    assert metric(queued_pool, "llamapool_queue_depth", model=MODEL) == 1
    held.close()
    r = waiter.result(timeout=TIMEOUT_S)
    answered_in = time.monotonic() - submitted
    assert r.status_code == 200, r.text
    assert waiting(queued_pool) == 0
    # Its wait is in the histogram: one more job, waiting no longer than
    # the whole request took.
    count, total = waits()
    assert count == count_before + 1
    assert 0 < total - sum_before <= answered_in
    queued_pool.wait_free(1, 30)


def test_a_wait_longer_than_the_submit_timeout_is_not_a_lost_broker(
        short_answer_pool, clients):
    # Before, the frontend's link dropped QUEUED: a job queued for longer
    # than --submit-timeout-s was answered "the broker did not answer" while
    # the broker still held it, and ran it later for nobody.
    pool = short_answer_pool
    held, _ = hold_slot(pool, headers=auth(KEY_A))
    try:
        waiter = clients.submit(complete, pool, KEY_B)
        wait_until(lambda: waiting(pool) == 1, 30, "the request to wait")
        queued_at = time.monotonic()
        # Three submit timeouts pass, and it is still waiting, not failed.
        wait_until(lambda: waiter.done() or time.monotonic() - queued_at > 3, 30,
                   "three submit timeouts")
        assert not waiter.done(), waiter.result().text
        assert waiting(pool) == 1
    finally:
        held.close()
    r = waiter.result(timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    pool.wait_free(1, 30)


def test_the_request_can_shorten_its_wait(queued_pool):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    try:
        before = metric(queued_pool, "llamapool_queue_refused_total", model=MODEL,
                        reason="expired")
        r = complete(queued_pool, KEY_B, headers={"X-Max-Wait-S": "0.5"})
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert metric(queued_pool, "llamapool_queue_refused_total",
                      model=MODEL, reason="expired") == before + 1
        bad = complete(queued_pool, KEY_B, headers={"X-Max-Wait-S": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Max-Wait-S"
    finally:
        held.close()
    queued_pool.wait_free(1, 30)


def test_the_queue_is_bounded_by_count_and_by_prompt_tokens(tight_pool, clients):
    held, _ = hold_slot(tight_pool, headers=auth(KEY_A))
    try:
        # 60 prompt tokens at most may wait: this one alone is more.
        long_prompt = complete(tight_pool, KEY_B, prompt="hello " * 80)
        assert long_prompt.status_code == 503, long_prompt.text
        first = clients.submit(complete, tight_pool, KEY_B)
        wait_until(lambda: waiting(tight_pool) == 1, 30, "one waiter")
        second = complete(tight_pool, KEY_A)  # the one place is taken
        assert second.status_code == 503 and "Retry-After" in second.headers
        assert metric(tight_pool, "llamapool_queue_refused_total", model=MODEL,
                      reason="full") >= 2
    finally:
        held.close()
    assert first.result(timeout=TIMEOUT_S).status_code == 200
    tight_pool.wait_free(1, 30)


def _raw_request(pool, key: str, stream: bool) -> socket.socket:
    payload = json.dumps({"prompt": "Hi", "max_tokens": 4, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", pool.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 + f"Authorization: Bearer {key}\r\n".encode()
                 + b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_waiter_whose_client_leaves_is_gone_and_nothing_runs(queued_pool, stream):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    before = scrape(queued_pool)
    sock = _raw_request(queued_pool, KEY_B, stream)
    wait_until(lambda: waiting(queued_pool) == 1, 30, "the request to wait")
    sock.close()
    wait_until(lambda: waiting(queued_pool) == 0, 30, "the waiter to leave")
    held.close()
    queued_pool.wait_free(1, 30)
    after = scrape(queued_pool)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("llamapool_queue_refused_total", model=MODEL, reason="left") == 1
    # Only the held stream reached the worker (cancelled as it closed): the
    # waiter never ran.
    assert delta("llamapool_requests_cancelled_total", model=MODEL) == 1
    assert delta("llama_request_success_total", model=MODEL) == 0
    assert delta("llama_request_fail_total", model=MODEL) == 0


def test_a_freed_slot_goes_to_the_key_served_least(queued_pool, clients):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    # Key A has its stream and three waiting jobs; key B then sends one.
    futures = []
    for i in range(3):
        futures.append(clients.submit(complete, queued_pool, KEY_A, f"A{i} says hi"))
        wait_until(lambda n=i + 1: waiting(queued_pool) == n, 30, f"{i + 1} waiting")
    # B's job is a stream that stops reading once it has its first token, so
    # whoever got the freed slot keeps it: the order is read off the queue,
    # not off which client thread happened to finish first.
    b_stream = RawStream(queued_pool.port, LONG, headers=auth(KEY_B))
    try:
        wait_until(lambda: waiting(queued_pool) == 4, 30, "4 waiting")
        held.close()
        b_stream.read_until(b"data: ")
        # First in, first out would have run A's three jobs before B's;
        # fairness gives B the slot while all three still wait.
        assert waiting(queued_pool) == 3
    finally:
        b_stream.close()
    assert all(f.result(timeout=TIMEOUT_S).status_code == 200 for f in futures)
    queued_pool.wait_free(1, 30)
