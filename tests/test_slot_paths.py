"""Every way a slot lease can end, through real processes.

After each path the broker's ledger (asked over its real socket, not guessed
from timing) must show free slots == live workers.

Holding a stream open: a client that stops reading fills the (capped) kernel
buffers, the frontend stops returning credit, and the worker pauses. That
keeps a slot busy for as long as the test needs, without sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import pytest

from tests.pool import wait_until

pytestmark = pytest.mark.stack

LONG = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}


class RawStream:
    """An SSE request over a bare socket, so the test controls every byte read."""

    def __init__(self, port: int, body: dict, path: str = "/v1/completions",
                 headers: dict | None = None) -> None:
        self.sock = socket.socket()
        # A small receive window: the server's writes block soon after the
        # client stops reading.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\n{extra}\r\n".encode() + payload
        )
        self.data = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.data:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.data += chunk
        return self.data

    def read_to_end(self) -> bytes:
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                return self.data
            self.data += chunk
            if self.data.endswith(b"0\r\n\r\n"):  # last chunk of chunked encoding
                return self.data

    def header(self, name: str) -> str | None:
        head = self.read_until(b"\r\n\r\n").split(b"\r\n\r\n", 1)[0].decode()
        for line in head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None

    def close(self) -> None:
        self.sock.close()


def wait_paused(pool, slot_id: int) -> None:
    """Wait until a slot's generation stops advancing (credit exhausted)."""
    seen = []

    def paused():
        slot = next(s for s in pool.status()["slots"] if s["id"] == slot_id)
        seen.append(slot["progress"].get("n_generated"))
        return len(seen) > 5 and seen[-1] is not None and len(set(seen[-5:])) == 1

    wait_until(paused, 20, f"slot {slot_id} to pause", interval_s=0.1)


def hold_slot(pool, headers: dict | None = None) -> tuple[RawStream, int]:
    """Open a long stream and stop reading: its slot stays busy, paused."""
    stream = RawStream(pool.port, LONG, headers=headers)
    slot_id = int(stream.header("X-Slot-Id"))
    wait_paused(pool, slot_id)
    return stream, slot_id


def test_eof_releases(whole_pool):
    before = whole_pool.status()["counters"].get("finished", 0)
    with httpx.stream("POST", whole_pool.url + "/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 5, "stream": True}) as r:
        body = b"".join(r.iter_bytes())
    assert body.endswith(b"data: [DONE]\n\n")
    snap = whole_pool.assert_whole()
    assert snap["counters"]["finished"] == before + 1


def test_client_disconnect_mid_stream_cancels(whole_pool):
    before = whole_pool.status()["cancel_release_s"]["count"]
    stream = RawStream(whole_pool.port, LONG)
    slot_id = int(stream.header("X-Slot-Id"))
    stream.read_until(b"data: ")
    wait_paused(whole_pool, slot_id)
    stream.close()
    snap = whole_pool.assert_whole()
    # The slot came back through an acknowledged cancel, not by finishing.
    assert snap["cancel_release_s"]["count"] == before + 1
    assert snap["cancel_release_s"]["max"] < 5


def test_body_closed_unread(whole_pool):
    """The client goes away before reading a single event."""
    with httpx.Client() as client:
        with client.stream("POST", whole_pool.url + "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
    whole_pool.assert_whole()


def test_worker_killed_mid_stream_ends_with_error_event(whole_pool):
    stream = RawStream(whole_pool.port, LONG)
    slot_id = int(stream.header("X-Slot-Id"))
    stream.read_until(b"data: ")
    wait_paused(whole_pool, slot_id)
    slot = next(s for s in whole_pool.status()["slots"] if s["id"] == slot_id)
    os.kill(slot["pid"], signal.SIGKILL)
    victim = next(w for w in whole_pool.workers if w.pid == slot["pid"])
    victim.popen.wait(timeout=10)
    data = stream.read_to_end().decode()
    stream.close()
    events = [line[6:] for line in data.split("\n") if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "worker_died"
    assert "[DONE]" not in events
    # One worker is left and it is free; then a replacement joins.
    whole_pool.assert_whole()
    whole_pool.workers.remove(victim)
    whole_pool.start_worker()
    whole_pool.wait_free(2, timeout_s=30)


def test_two_streams_hold_both_slots_third_gets_503(whole_pool):
    streams = [RawStream(whole_pool.port, LONG) for _ in range(2)]
    try:
        for s in streams:
            wait_paused(whole_pool, int(s.header("X-Slot-Id")))
        assert whole_pool.status()["slots_free"] == 0
        r = httpx.post(whole_pool.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json() == {"error": {"code": 503, "message": "no slot available",
                                      "type": "unavailable_error"}}
    finally:
        for s in streams:
            s.close()
    whole_pool.assert_whole()


def test_slow_reader_pauses_generation(whole_pool):
    """A reader that stops pauses its worker: output in flight stays bounded."""
    stream, slot_id = hold_slot(whole_pool)
    slot = next(s for s in whole_pool.status()["slots"] if s["id"] == slot_id)
    assert slot["state"] == "busy"
    assert slot["progress"]["n_generated"] < LONG["max_tokens"]
    # Reading again resumes it, to the end.
    data = stream.read_to_end()
    stream.close()
    assert data.rstrip(b"\r\n0").endswith(b"data: [DONE]")
    whole_pool.assert_whole()
