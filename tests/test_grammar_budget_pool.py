"""Grammars that explode, and clients that leave, through real gunicorn, a
real broker and a worker on the tiny GGUF (issue 29, item 1).

Before: a 360-byte grammar passed the door in 0.03 s and pinned a worker in
one C call (142 CPU s after 90 s, slot busy, client gone at 10 s); without
its leading literal the door's own check took 26 CPU s in a gunicorn thread
and the job was submitted anyway; a JSON-schema ``pattern`` held a slot for
minutes; ``"a"{3,1}`` made llama.cpp allocate until the process compiling
it was killed. Now each is a 400 at the door, nothing reaches the broker,
and a grammar whose stacks multiply with the text ends its stream with an
error event once they pass the budget. A client that has left before its
job starts gets no SUBMIT.
"""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pool import sse_events, wait_until
from tests.pool_factory import pool_fixture
from tests.test_grammar_stacks import AMBIGUOUS, nested_optionals

pytestmark = pytest.mark.stack

TIMEOUT_S = 120

#: One gunicorn worker, so that stopping it holds every request.
one_frontend = pool_fixture(workers=1, frontend_env={"LLAMAPOOL_FRONTEND_PROCESSES": "1"})


def scrape(pool) -> dict:
    text = httpx.get(pool.url + "/metrics", timeout=TIMEOUT_S).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}


def counted(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def reached_the_broker(samples: dict) -> float:
    # The pool's one model (its workers' file's name) labels the series.
    return counted(samples, "llamapool_request_duration_seconds_count",
                   model="tiny.gguf")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n_predict": 4, "grammar": nested_optionals(20, '"a"')}, "grammar"),
    ({"prompt": "x", "n_predict": 4, "grammar": nested_optionals(17)}, "grammar"),
    ({"prompt": "x", "n_predict": 4, "grammar": 'root ::= "a"{3,1}'}, "grammar"),
    ({"prompt": "x", "n_predict": 4, "json_schema": {
        "type": "string", "pattern": "^((((a?){8}){8}){8}){8}$"}}, "json_schema"),
])
def test_an_exploding_grammar_is_a_400_at_the_door(one_frontend, body, param):
    before = scrape(one_frontend)
    r = httpx.post(one_frontend.url + "/completion", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert any(words in error["message"] for words in
               ("parse stacks", "below its minimum")), error
    after = scrape(one_frontend)
    assert reached_the_broker(after) == reached_the_broker(before)
    one_frontend.assert_whole()


def test_the_same_through_openai_response_format(one_frontend):
    schema = {"type": "string", "pattern": "^((((a?){8}){8}){8}){8}$"}
    r = httpx.post(one_frontend.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_stacks_that_multiply_with_the_text_end_the_stream_with_an_error(one_frontend):
    # Every stack allows only "a" and ignore_eos bans the end, so the tiny
    # model must write a's: 6, 14, 29, 60, 122 stacks, then the refusal.
    body = {"prompt": "x", "n_predict": 64, "ignore_eos": True, "stream": True,
            "grammar": AMBIGUOUS}
    with httpx.stream("POST", one_frontend.url + "/completion", json=body,
                      timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and "parse stacks" in errors[-1]["error"]["message"], events
    text = "".join(e.get("content", "") for e in events
                   if isinstance(e, dict) and "error" not in e)
    assert set(text) <= {"a"} and 1 <= len(text) <= 5, text
    one_frontend.assert_whole()
    # The worker is the same process, and serves the next request.
    r = httpx.post(one_frontend.url + "/completion", timeout=TIMEOUT_S,
                   json={"prompt": "x", "n_predict": 2})
    assert r.status_code == 200


def _frontend_worker_pid(pool) -> int:
    r = httpx.post(pool.url + "/completion", json={"prompt": "x", "n_predict": 1},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200
    return int(r.headers["X-Frontend-Pid"])


def test_a_client_that_left_before_its_job_started_gets_no_submit(one_frontend):
    pid = _frontend_worker_pid(one_frontend)
    before = scrape(one_frontend)
    payload = json.dumps({"prompt": "hello", "n_predict": 8}).encode()
    # The frontend is held while the client sends its request and leaves:
    # when it runs again, the whole request and the close are both there.
    os.kill(pid, signal.SIGSTOP)
    try:
        sock = socket.create_connection(("127.0.0.1", one_frontend.port))
        sock.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        sock.close()
    finally:
        os.kill(pid, signal.SIGCONT)

    def rejected():
        samples = scrape(one_frontend)
        return samples if counted(samples, "llamapool_requests_rejected_total",
                                  reason="client_gone") > counted(
            before, "llamapool_requests_rejected_total", reason="client_gone") else None

    after = wait_until(rejected, 60, "the frontend to count the client that left")
    assert reached_the_broker(after) == reached_the_broker(before)
    one_frontend.assert_whole()
