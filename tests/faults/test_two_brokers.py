"""Two brokers share the pool; killing one costs only its own streams.

Real processes on loopback: two brokers, two synthetic workers (one starts
on each broker), one gunicorn frontend connected to both. The figures
(streams lost, requests refused, time to re-home) are printed for
BENCHMARKS.md. One test runs as deployed instead: loopback TCP, tiny-model
workers and every process at the default heartbeat, where a lost broker's
streams must end within its liveness window plus one interval.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from frontend.pool_view import SLOT_ID_STRIDE
from protocol import timing
from tests.brokers_pool import BrokersPool
from tests.pool import wait_until
from tests.test_slot_paths import RawStream

pytestmark = pytest.mark.stack

#: 25 tokens/s: a 250-token stream runs about 10 s.
SYNTHETIC = ("--engine", "synthetic", "--tokens-per-second", "25")


@pytest.fixture
def two_brokers(tmp_path):
    pool = BrokersPool(tmp_path, worker_args=SYNTHETIC)
    yield pool
    pool.stop()


@pytest.fixture
def two_brokers_tokenizing(tmp_path, tiny_model):
    """One gunicorn process that counts prompt tokens (so it fingerprints
    prompt prefixes), in front of two brokers."""
    pool = BrokersPool(tmp_path, worker_args=SYNTHETIC, frontend_processes=1,
                       frontend_args=("--model", str(tiny_model)))
    yield pool
    pool.stop()


@pytest.fixture
def two_brokers_as_deployed(tmp_path, tiny_model):
    """Two brokers on loopback TCP, two tiny-model workers, one gunicorn
    process; nobody is given a heartbeat flag (1 s x 3)."""
    pool = BrokersPool(tmp_path, heartbeat=(), transport="tcp",
                       frontend_processes=1,
                       worker_args=("--model", str(tiny_model), "--threads", "1",
                                    "--ctx", "2048"))
    yield pool
    pool.stop()


def completion(pool: BrokersPool, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(pool.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": max_tokens}, timeout=30)


def stream_outcome(data: bytes) -> str:
    """'error', a finish_reason, or 'cut' if the stream ended without one."""
    for line in data.decode(errors="replace").split("\n"):
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return "error"
        reason = event["choices"][0].get("finish_reason")
        if reason:
            return reason
    return "cut"


def test_pool_views_show_both_brokers_once(two_brokers):
    pool = two_brokers
    health = httpx.get(pool.url + "/health", timeout=10).json()
    assert health["slots_idle"] == 2, health
    slots = httpx.get(pool.url + "/slots", timeout=10).json()
    assert len(slots) == 2, slots
    # One slot from each broker's ledger, ids kept apart.
    assert sorted(s["id"] // SLOT_ID_STRIDE for s in slots) == [0, 1], slots
    models = httpx.get(pool.url + "/v1/models", timeout=10).json()["data"]
    assert [m["meta"]["slots"] for m in models] == [2], models
    metrics = httpx.get(pool.url + "/metrics", timeout=10).text
    assert "llama_slots_processing" in metrics


def test_a_full_broker_falls_back_to_the_other(two_brokers):
    """Each broker has one worker. With one busy, every request is served
    (a refusal from the full broker moves it on); with both busy, 503."""
    pool = two_brokers
    # Long enough to outlast the test under any load; ended by hanging up.
    endless = {"prompt": "x", "max_tokens": 2000, "stream": True}
    held = RawStream(pool.port, endless)
    held.read_until(b"data: ")
    for _ in range(4):
        r = completion(pool)
        assert r.status_code == 200, r.text
    other = RawStream(pool.port, endless)
    other.read_until(b"data: ")
    ids = {int(held.header("X-Slot-Id")) // SLOT_ID_STRIDE,
           int(other.header("X-Slot-Id")) // SLOT_ID_STRIDE}
    assert ids == {0, 1}
    busy = completion(pool)
    assert busy.status_code == 503, busy.text
    assert int(busy.headers["Retry-After"]) >= 1
    for stream in (held, other):
        stream.sock.close()  # the client hangs up: CANCEL frees each slot
    pool.wait_free(0, 1)
    pool.wait_free(1, 1)


def test_killing_one_broker_costs_only_its_streams(two_brokers):
    pool = two_brokers
    # 250 tokens at 25/s: 10 s, far longer than the setup below takes.
    streams = [RawStream(pool.port, {"prompt": p, "max_tokens": 250, "stream": True})
               for p in ("a", "b")]
    for s in streams:
        s.read_until(b"data: ")
    on_broker = {int(s.header("X-Slot-Id")) // SLOT_ID_STRIDE: s for s in streams}
    assert set(on_broker) == {0, 1}

    outcomes: dict[int, str] = {}

    def read(i: int) -> None:
        outcomes[i] = stream_outcome(on_broker[i].read_to_end())

    readers = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for t in readers:
        t.start()
    killed_at = time.monotonic()
    pool.brokers[0].kill()

    # Broker 0's worker moves to broker 1 (keeping its model) once broker 0
    # is silent for the liveness window; broker 1's stream goes on.
    def rehomed():
        s = pool.slots(1)
        return s is not None and s[0] == 2
    wait_until(rehomed, 30, "broker 0's worker to register with broker 1")
    rehome_s = time.monotonic() - killed_at
    for t in readers:
        t.join(30)
    assert outcomes == {0: "error", 1: "length"}, (outcomes, pool.logs()[-4000:])

    # Every request after the re-homing is served, none waits for broker 0.
    pool.wait_free(1, 2)
    refused = 0
    slowest_s = 0.0
    for _ in range(6):
        started = time.monotonic()
        r = completion(pool)
        slowest_s = max(slowest_s, time.monotonic() - started)
        refused += r.status_code == 503
        assert r.status_code in (200, 503), r.text
    assert refused == 0
    health = httpx.get(pool.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["slots_idle"] == 2

    # Broker 0 comes back empty; nothing leaked anywhere, nothing counted twice.
    pool.restart_broker(0)
    wait_until(lambda: pool.slots(0) == (0, 0), 30, "broker 0 back, empty")
    pool.wait_free(1, 2)
    slots = httpx.get(pool.url + "/slots", timeout=10).json()
    assert len(slots) == 2 and all(s["state"] == "idle" for s in slots), slots
    print(f"\nbroker kill: streams lost 1 of 2, re-home {rehome_s:.2f}s, "
          f"refused after re-home {refused}/6, slowest {slowest_s:.2f}s")


def error_event(data: bytes) -> dict | None:
    """The stream's error event (its ``error`` object), if it has one."""
    for line in data.decode(errors="replace").split("\n"):
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]
    return None


def test_a_killed_brokers_stream_ends_within_its_liveness_window(
        two_brokers_as_deployed, record_property):
    """``kill -9`` of the broker relaying a stream, at the default heartbeat:
    the client reads the error event within the liveness window plus one
    interval of the kill (issue 27 measured 9.6 s and 10.9 s; the bound is
    4 s)."""
    pool = two_brokers_as_deployed
    bound_s = timing.HEARTBEAT_INTERVAL_S * (timing.HEARTBEAT_LIVENESS + 1)
    # Longer than what the frontend's buffers and the credit window hold:
    # the client reads nothing until the kill, so the worker pauses on
    # credit with the job still running, however fast it generates.
    stream = RawStream(pool.port, {"prompt": "Hello", "max_tokens": 2000,
                                   "ignore_eos": True, "stream": True})
    stream.read_until(b"data: ")
    broker = int(stream.header("X-Slot-Id")) // SLOT_ID_STRIDE
    killed_at = time.monotonic()
    pool.brokers[broker].kill()
    # The response ends right after its error event.
    data = stream.read_to_end()
    error_after_s = time.monotonic() - killed_at
    error = error_event(data)
    assert error is not None and error["code"] == "broker_unreachable", \
        (data[-500:], pool.logs()[-4000:])
    print(f"\nbroker kill at 1 s x 3: error event after {error_after_s:.2f} s")
    record_property("error_after_s", round(error_after_s, 3))
    assert error_after_s <= bound_s, pool.logs()[-4000:]
    # The killed broker's worker moves to the survivor; nothing leaked.
    pool.wait_free(1 - broker, 2, timeout_s=30)


def test_a_follow_up_turn_reaches_the_broker_of_its_conversation(
        two_brokers_tokenizing):
    """Round robin alone would send every other turn to the other broker;
    the frontend remembers which broker served each conversation's prefix."""
    pool = two_brokers_tokenizing
    brokers_of: dict[int, set[int]] = {}
    for c in range(4):
        history = f"conversation {c}: " + " ".join(f"w{c}x{i}" for i in range(80))
        for turn in range(3):
            history += f" turn {turn}"
            r = httpx.post(pool.url + "/v1/completions", timeout=30,
                           json={"prompt": history, "max_tokens": 2})
            assert r.status_code == 200, r.text
            brokers_of.setdefault(c, set()).add(
                int(r.headers["X-Slot-Id"]) // SLOT_ID_STRIDE)
            history += r.json()["choices"][0]["text"]
    assert all(len(b) == 1 for b in brokers_of.values()), brokers_of
    # And the conversations did not all go to one broker.
    assert set().union(*brokers_of.values()) == {0, 1}, brokers_of
