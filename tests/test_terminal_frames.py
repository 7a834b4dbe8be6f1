"""A rogue worker's terminal frames, against a real broker and real gunicorn.

FINAL's ``usage`` and ``timings`` were untyped maps: a worker could put a
string, a list, NaN or bytes in them, and the frontend wrote them into the
client's JSON (NaN is no JSON; bytes made a 500 or cut the stream after its
headers), while a FINAL whose fields did not decode at all was dropped and
left the job, and its slot, waiting for a terminal frame that never came.

Now they are typed and range-checked on decode, and a broken job frame from
the worker that holds the job fails the job with ``worker_protocol_error``
(502, or an error event mid-stream) and disconnects that worker, which
registers again. The client always gets well-formed JSON, and the slot comes
back after every case.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from protocol import messages
from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until
from tests.test_payloads import FakePeer

pytestmark = pytest.mark.stack

H = messages.PROTOCOL_HEADER
USAGE = [3, 2, 5, 1]
TIMINGS = [2, 1.5, 2, 3.0, 666.7, 1]  # the last: cache_n


def final_body(job_id: str, *, reason="stop", usage=USAGE, timings=TIMINGS,
               text="!", logprobs=(), extra=()) -> list:
    return [job_id, reason, usage, timings, text, list(logprobs), *extra]


#: (name, body maker, whether the frame is valid).
CASES = [
    ("valid", lambda j: final_body(j), True),
    ("valid, optional fields left out",
     lambda j: final_body(j, usage=USAGE[:3], timings=TIMINGS[:4]), True),
    ("valid, a newer peer's extra fields",
     lambda j: final_body(j, usage=[*USAGE, "future"], timings=[*TIMINGS, [1]],
                          extra=("future",)), True),
    ("usage as the old map",
     lambda j: final_body(j, usage={"prompt_tokens": 3, "completion_tokens": 2}),
     False),
    ("a count as a string", lambda j: final_body(j, usage=["3", 2, 5]), False),
    ("a count as a list", lambda j: final_body(j, usage=[3, [2], 5]), False),
    ("a count as a float", lambda j: final_body(j, usage=[3, 2.0, 5]), False),
    ("a count as a bool", lambda j: final_body(j, usage=[3, True, 5]), False),
    ("a negative count", lambda j: final_body(j, usage=[-3, 2, 5]), False),
    ("a huge count", lambda j: final_body(j, usage=[3, 2**64 - 1, 5]), False),
    ("a NaN time", lambda j: final_body(j, timings=[2, math.nan, 2, 3.0]), False),
    ("an infinite rate",
     lambda j: final_body(j, timings=[2, 1.5, 2, 3.0, math.inf]), False),
    ("a negative time", lambda j: final_body(j, timings=[2, 1.5, 2, -3.0]), False),
    ("a time as a string", lambda j: final_body(j, timings=[2, "1.5", 2, 3.0]),
     False),
    ("bytes in timings", lambda j: final_body(j, timings=[2, b"\x00", 2, 3.0]),
     False),
    ("timings as a map with bytes",
     lambda j: final_body(j, timings={"prompt_ms": b"\x00"}), False),
    ("usage missing", lambda j: [j, "stop"], False),
    ("usage too short", lambda j: final_body(j, usage=[3]), False),
    ("an unknown finish reason", lambda j: final_body(j, reason="exploded"), False),
    ("a finish reason as an int", lambda j: final_body(j, reason=5), False),
    ("text as an int", lambda j: final_body(j, text=7), False),
    ("not an array", lambda j: {"job_id": j}, False),
]


@contextlib.contextmanager
def rogue_worker_pool(run_dir: Path):
    """A real broker and gunicorn whose only worker the caller plays by hand
    (``FakePeer``); yields (broker, frontend, port, probe, worker). Also used
    by ``tests/bench/bench_rogue_final.py``."""
    frontends, workers = f"ipc://{run_dir}/frontends", f"ipc://{run_dir}/workers"
    # Peers are dead after 10 s of silence: no step here comes near it.
    broker = Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                                workers, "--heartbeat-interval-s", "0.2",
                                "--heartbeat-liveness", "50"), run_dir)
    port = free_port()
    # A short frame timeout: before the fix a dropped FINAL left the request
    # waiting for one (600 s by default).
    env = dict(os.environ, LLAMAPOOL_FRAME_TIMEOUT_S="5",
               LLAMAPOOL_FRONTEND_PROCESSES="1", LLAMAPOOL_FRONTEND_THREADS="8")
    frontend = Proc("frontend", cli("frontend", "--broker", frontends, "--bind",
                                    f"127.0.0.1:{port}", *TEST_HEARTBEAT),
                    run_dir, env=env)
    ctx = zmq.Context()
    probe = BrokerProbe(frontends, ctx=ctx)
    worker = FakePeer(ctx, workers)

    def http_up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1
                             ).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    try:
        wait_until(http_up, 60, "gunicorn to answer")
        yield broker, frontend, port, probe, worker
    finally:
        probe.close()
        ctx.destroy(linger=0)
        codes = [frontend.stop(), broker.stop()]
        assert codes == [0, 0], frontend.log() + broker.log()


@pytest.fixture(scope="module")
def rogue_pool(tmp_path_factory):
    with rogue_worker_pool(tmp_path_factory.mktemp("rogue")) as pool:
        yield pool


def register(worker: FakePeer, probe: BrokerProbe) -> None:
    worker.send(messages.Ready("rogue", "m", 2048, os.getpid(), "h").to_wire())
    wait_until(lambda: (probe.status(1) or {}).get("slots_free") == 1, 20,
               "the fake worker to be a free slot")


def ask(port: int, stream: bool) -> tuple[int, str]:
    body = {"prompt": "Hi", "max_tokens": 5, "stream": stream}
    url = f"http://127.0.0.1:{port}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        return r.status_code, r.read().decode()


def strict_json(text: str):
    """JSON as a strict client reads it: NaN and Infinity are no JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line]
    return [line if line == "[DONE]" else strict_json(line) for line in lines]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_final_ends_in_well_formed_json_and_frees_the_slot(rogue_pool, stream):
    broker, frontend, port, probe, worker = rogue_pool
    register(worker, probe)
    failures = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for name, make_body, valid in CASES:
            asked = pool.submit(ask, port, stream)
            job_id = worker.expect(messages.Submit).job_id
            worker.send(messages.Token(job_id, "Hello").to_wire())
            worker.send([H, messages.Final.COMMAND, msgpack.packb(make_body(job_id))])
            status, text = asked.result(timeout=60)
            try:
                check_answer(status, text, stream, valid)
            except (AssertionError, ValueError) as exc:
                failures.append(f"{name}: {exc!r}: {status} {text[:300]!r}")
            if not valid:
                try:
                    worker.expect(messages.Disconnect, timeout_s=5)
                except AssertionError:
                    failures.append(f"{name}: the worker was not disconnected")
            # READY frees the slot, also if the broker still thought it busy.
            register(worker, probe)
    assert broker.alive() and frontend.alive()
    assert not failures, "\n".join(failures)
    assert "Traceback" not in frontend.log()
    counters = probe.status(2)["counters"]
    assert counters["worker_protocol_errors"] >= sum(not v for *_, v in CASES)


def check_answer(status: int, text: str, stream: bool, valid: bool) -> None:
    if not stream:
        body = strict_json(text)
        if valid:
            assert status == 200
            assert body["choices"][0]["text"] == "Hello!"
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == 2
            assert body["usage"]["total_tokens"] == 5
            assert all(isinstance(v, (int, float)) for v in body["timings"].values())
        else:
            assert status == 502
            assert body["error"]["code"] == "worker_protocol_error"
        return
    assert status == 200  # the headers went out with the first token
    events = sse_events(text)
    assert events[0]["choices"][0]["text"] == "Hello"
    if valid:
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    else:
        assert "[DONE]" not in events
        error = events[-1]["error"]
        assert (error["code"], error["status"]) == ("worker_protocol_error", 502)


def test_a_broken_token_fails_the_job_too(rogue_pool):
    """Lost output is a broken job as well; a broken heartbeat is only dropped."""
    broker, frontend, port, probe, worker = rogue_pool
    register(worker, probe)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(ask, port, True)
        job_id = worker.expect(messages.Submit).job_id
        worker.send(messages.Token(job_id, "Hello").to_wire())
        worker.send([H, messages.Heartbeat.COMMAND, msgpack.packb([[job_id, "x"]])])
        worker.send([H, messages.Token.COMMAND, msgpack.packb([job_id, 5])])
        status, text = asked.result(timeout=60)
    assert status == 200
    events = sse_events(text)
    assert events[-1]["error"]["code"] == "worker_protocol_error"
    worker.expect(messages.Disconnect)
    register(worker, probe)


def test_a_token_of_another_job_never_reaches_the_client(rogue_pool):
    """The broker relays TOKEN bodies without decoding them, but still by the
    job id they name: a TOKEN of any other job (an old one, an id that begins
    like this one's, or one this one's begins like) goes to nobody, and the
    job's own frames still arrive whole."""
    broker, frontend, port, probe, worker = rogue_pool
    register(worker, probe)
    stale_before = probe.status(2)["counters"].get("stale_frames", 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(ask, port, True)
        job_id = worker.expect(messages.Submit).job_id
        worker.send(messages.Token(job_id, "Hello").to_wire())
        for other in (job_id[:-1], job_id + "0", "old-job"):
            worker.send(messages.Token(other, " LEAKED").to_wire())
        worker.send([H, messages.Final.COMMAND, msgpack.packb(final_body(job_id))])
        status, text = asked.result(timeout=60)
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]
                   if e["choices"]) == "Hello!"
    assert probe.status(2)["counters"]["stale_frames"] - stale_before == 3
