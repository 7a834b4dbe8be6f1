"""Fault injection against real processes. Each scenario ends whole.

"Whole" means the broker's ledger shows every live worker registered and
free; it is asked over its real socket (``Pool.wait_free``), never inferred
from a sleep.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest
import zmq

from protocol import messages
from tests.faults.conftest import figures
from tests.pool import BrokerProbe, wait_until
from tests.test_slot_paths import LONG, RawStream, wait_paused

pytestmark = pytest.mark.stack


def record_recovery(pool, fig, fault_at: float, n_workers: int = 2) -> None:
    """Wait for the pool to be whole; record how long it took, or the leak."""
    try:
        pool.wait_free(n_workers, timeout_s=30)
    except AssertionError:
        snap = pool.status()
        fig.leaked_slots += pool.live_workers() - snap["slots_free"]
        raise
    fig.recovery_s.append(time.monotonic() - fault_at)


def record_releases(pool, fig, before_count: int) -> None:
    """Disconnect-to-release latencies of the cancels since ``before_count``."""
    stats = pool.status()["cancel_release_s"]
    new = stats["count"] - before_count
    if new > 0:
        fig.release_s.extend(stats["recent"][-new:])


def error_events(data: bytes) -> list[dict]:
    events = []
    for line in data.decode(errors="replace").split("\n"):
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            if "error" in obj:
                events.append(obj["error"])
    return events


# 1 -----------------------------------------------------------------------------------


def test_kill_worker_mid_stream_20_times(fault_pool):
    pool, fig = fault_pool, figures("1. kill -9 worker mid-stream x20")
    for _ in range(20):
        stream = RawStream(pool.port, LONG)
        slot_id = int(stream.header("X-Slot-Id"))
        stream.read_until(b"data: ")
        pid = next(s["pid"] for s in pool.status()["slots"] if s["id"] == slot_id)
        fault_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        fig.faults += 1
        victim = next(w for w in pool.workers if w.pid == pid)
        victim.popen.wait(timeout=10)
        data = stream.read_to_end()
        stream.close()
        errors = error_events(data)
        if not errors or b"[DONE]" in data:
            fig.unexpected_failures += 1  # the client did not see how it ended
        pool.workers.remove(victim)
        pool.start_worker()
        record_recovery(pool, fig, fault_at)
    assert fig.unexpected_failures == 0


# 2 -----------------------------------------------------------------------------------


def _client_that_disconnects(port: int, rng: random.Random, results: list) -> None:
    """One streaming client that hangs up at a random point."""
    point = rng.choice(["before_first_token", "mid_stream", "at_the_end"])
    body = {"prompt": "Hello world", "stream": True, "ignore_eos": True,
            "max_tokens": rng.choice([8, 64, 400])}
    deadline = time.monotonic() + 30
    while True:
        if time.monotonic() > deadline:
            results.append("no slot for 30 s")  # a leak would end up here
            return
        payload = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Length: " + str(len(payload)).encode()
                  + b"\r\n\r\n" + payload)
        if point == "before_first_token":
            s.close()
            results.append("ok")
            return
        data = s.recv(65536)
        if b" 503 " in data.split(b"\r\n", 1)[0]:
            s.close()  # admission control, not a failure: wait for a slot
            time.sleep(0.01)  # back-off between retries, not synchronisation
            continue
        if b" 200 " not in data.split(b"\r\n", 1)[0]:
            results.append("bad status")
            s.close()
            return
        if point == "mid_stream":
            while data.count(b"data: ") < 3 and (chunk := s.recv(65536)):
                data += chunk
        else:
            while b"[DONE]" not in data and (chunk := s.recv(65536)):
                data += chunk
        s.close()
        results.append("ok" if b'"error"' not in data else "error event")
        return


def test_200_clients_disconnect_at_random_points(fault_pool):
    pool, fig = fault_pool, figures("2. 200 clients disconnect randomly")
    before = pool.status()["cancel_release_s"]["count"]
    rng = random.Random(7)
    results: list[str] = []
    for _batch in range(50):
        threads = [threading.Thread(target=_client_that_disconnects, daemon=True,
                                    args=(pool.port, random.Random(rng.random()),
                                          results)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    fig.faults = len(results)
    fig.unexpected_failures = sum(1 for r in results if r != "ok")
    record_recovery(pool, fig, time.monotonic())  # from the last hang-up
    snap = pool.assert_whole()
    record_releases(pool, fig, before)
    fig.notes = f"{snap['cancel_release_s']['count'] - before} acknowledged cancels"
    assert len(results) == 200 and fig.unexpected_failures == 0


# 3 -----------------------------------------------------------------------------------


def test_kill_gunicorn_worker_holding_two_streams(fault_pool):
    pool, fig = fault_pool, figures("3. kill gunicorn worker with 2 streams")
    before = pool.status()["cancel_release_s"]["count"]
    # Two streams held by the same gunicorn process (it runs 2 processes).
    first = RawStream(pool.port, LONG)
    wait_paused(pool, int(first.header("X-Slot-Id")))
    holder = first.header("X-Frontend-Pid")
    second = None
    for _ in range(40):
        candidate = RawStream(pool.port, LONG)
        if candidate.header("X-Frontend-Pid") == holder:
            second = candidate
            break
        candidate.close()  # other process: hang up and wait for the slot back
        wait_until(lambda: pool.status()["slots_free"] == 1, 15, "slot back")
    assert second is not None, "could not land two streams on one process"
    wait_paused(pool, int(second.header("X-Slot-Id")))
    streams = [first, second]
    assert pool.status()["slots_free"] == 0
    pids = {int(holder)}
    fault_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    fig.faults += 1
    for s in streams:
        s.read_to_end()
        s.close()
    record_recovery(pool, fig, fault_at)
    # gunicorn replaces its worker; the pool serves again.
    wait_until(lambda: httpx.post(pool.url + "/v1/completions", json={
        "prompt": "Hi", "max_tokens": 2}).status_code == 200, 30, "service again")
    record_releases(pool, fig, before)
    # The broker cancelled the dead frontend's jobs (the fault pool's stall
    # timeout is long enough that neither ended on its own first).
    assert pool.status()["cancel_release_s"]["count"] >= before + 2


# 4 -----------------------------------------------------------------------------------


def test_broker_restart_under_load(fault_pool):
    pool, fig = fault_pool, figures("4. broker restart under load")
    stop = threading.Event()
    outcomes: list[int] = []

    def keep_requesting():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    r = client.post(pool.url + "/v1/completions",
                                    json={"prompt": "Hi", "max_tokens": 4})
                    outcomes.append(r.status_code)
                except httpx.TransportError:
                    outcomes.append(0)

    streams = [RawStream(pool.port, LONG) for _ in range(2)]
    for s in streams:
        wait_paused(pool, int(s.header("X-Slot-Id")))
    requester = threading.Thread(target=keep_requesting, daemon=True)
    requester.start()
    try:
        fault_at = time.monotonic()
        pool.restart_broker(kill=True)
        fig.faults += 1
        for s in streams:
            data = s.read_to_end()
            s.close()
            if not error_events(data):
                fig.unexpected_failures += 1
        pool.probe.close()
        pool.probe = BrokerProbe(pool.frontends_ep)
        record_recovery(pool, fig, fault_at)
        # New requests succeed again once workers have re-registered.
        n_before = len(outcomes)
        wait_until(lambda: 200 in outcomes[n_before:], 30,
                   "a request to succeed again")
    finally:
        # Always stop the client thread: a failure above must not leave it
        # spinning (and pytest waiting for it).
        stop.set()
        requester.join(timeout=30)
    # During the outage requests got 503 (no slot/broker) — the injected fault;
    # anything else (a 500, a dropped connection) is a failure.
    fig.unexpected_failures += sum(1 for c in outcomes if c not in (200, 503))
    fig.notes = f"{outcomes.count(503)} x 503 during the outage, " \
                f"{outcomes.count(200)} x 200"
    assert fig.unexpected_failures == 0


# 5 -----------------------------------------------------------------------------------


def test_slow_reader_pauses_then_is_cancelled(fault_pool):
    """One byte per 100 ms: generation pauses (bounded buffers), then the
    stall timeout (10 s here) ends the job and frees the slot."""
    pool, fig = fault_pool, figures("5. slow reader (1 byte / 100 ms)")
    stream = RawStream(pool.port, {**LONG, "max_tokens": 2040})
    slot_id = int(stream.header("X-Slot-Id"))
    fault_at = time.monotonic()
    fig.faults += 1
    generated = []
    while True:
        chunk = stream.sock.recv(1)
        if not chunk:
            break
        stream.data += chunk
        slot = next((s for s in pool.status()["slots"] if s["id"] == slot_id), None)
        if slot is None or slot["id_task"] is None:
            break  # the job ended: stalled out
        generated.append(slot["progress"].get("n_generated") or 0)
        time.sleep(0.1)  # the slow reader's pace is the scenario itself
    stream.close()
    record_recovery(pool, fig, fault_at)
    # Generation stopped far short of max_tokens: output in flight is bounded.
    assert max(generated) < 2040
    assert len(set(generated[-10:])) == 1, "generation did not pause"
    fig.notes = f"paused at {max(generated)} tokens, then cancelled"


# 6 -----------------------------------------------------------------------------------


def garbage_messages(rng: random.Random) -> list[list[bytes]]:
    valid_cancel = messages.Cancel("nope").to_wire()
    out = []
    for _ in range(50):
        out.append([rng.randbytes(rng.randint(0, 64))])
        out.append([rng.randbytes(8) for _ in range(rng.randint(1, 5))])
    out += [
        valid_cancel[:1], valid_cancel[:2],                       # truncated
        [messages.PROTOCOL_HEADER, messages.Submit.COMMAND, b"\xc1\xc1"],
        [messages.PROTOCOL_HEADER, messages.Ready.COMMAND, b"\x93\x01\x02\x03"],
        [messages.PROTOCOL_HEADER, messages.Token.COMMAND, rng.randbytes(40)],
        [b"LLAMAPOOL99", messages.Cancel.COMMAND, valid_cancel[2]],  # version
        [messages.PROTOCOL_HEADER, b"\xff", valid_cancel[2]],
        messages.Token("unknown-job", "x").to_wire(),  # well-formed, not yours
        messages.Credit("unknown-job", 5).to_wire(),
    ]
    return out


def test_garbage_on_every_zeromq_socket(fault_pool):
    pool, fig = fault_pool, figures("6. garbage on ZeroMQ sockets")
    before = pool.status()["counters"].get("malformed_dropped", 0)
    rng = random.Random(99)
    ctx = zmq.Context()
    sent = 0
    socks = []
    for endpoint in (pool.frontends_ep, pool.workers_ep):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
        for frames in garbage_messages(rng):
            sock.send_multipart(frames)
            sent += 1
    fig.faults = sent
    # The sockets stay open until the broker has read the garbage: it takes a
    # peer's frames a few dozen at a time (its RCVHWM), and closing a TCP
    # socket with unread input (the broker's DISCONNECT replies) resets it,
    # which would throw away what the broker had not read yet.
    wait_until(lambda: pool.status()["counters"].get("malformed_dropped", 0)
               - before >= 200, 60, "the broker to drop the garbage")
    for sock in socks:
        sock.close()
    ctx.term()
    procs = [pool.broker, pool.frontend, *pool.workers]
    assert all(p.alive() for p in procs)
    for _ in range(10):
        r = httpx.post(pool.url + "/v1/completions", json={"prompt": "Hi",
                                                           "max_tokens": 3})
        if r.status_code != 200:
            fig.unexpected_failures += 1
    record_recovery(pool, fig, time.monotonic())
    dropped = pool.status()["counters"].get("malformed_dropped", 0) - before
    fig.notes = f"{dropped} dropped and counted, all processes up"
    assert fig.unexpected_failures == 0
