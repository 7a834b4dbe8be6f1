"""Where a request ends (``llamapool.request_framing``), fed whole or a byte at a time.

The gunicorn worker gives a thread to a request only when this says it has
arrived; ``tests/test_http_deadlines.py`` checks the worker end to end.
"""

from __future__ import annotations

import pytest

from llamapool.request_framing import Progress, RequestFraming

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


def fed_bytewise(data: bytes, max_body: int = 100) -> list[Progress]:
    framing = RequestFraming(max_head_bytes=10_000, max_body_bytes=max_body)
    return [framing.advance(data[:i]) for i in range(1, len(data) + 1)]


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"\r\nGET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    HEAD + b"Content-Length: 5\r\n\r\nabcde",
    CHUNKED + b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n",
    CHUNKED + b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n",
])
def test_ready_exactly_when_the_last_byte_arrives(request_bytes):
    progress = fed_bytewise(request_bytes)
    assert progress[-1] is Progress.READY
    assert Progress.READY not in progress[:-1]


@pytest.mark.parametrize("request_bytes", [
    HEAD + b"Content-Length: zz\r\n\r\n",              # gunicorn answers 400
    HEAD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n",
    HEAD + b"Transfer-Encoding: gzip\r\n\r\n",          # gunicorn answers 501
    HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    HEAD + b"no colon here\r\n\r\n",
    CHUNKED + b"zz\r\n",                                # bad chunk size
])
def test_what_it_cannot_frame_goes_to_gunicorn_at_once(request_bytes):
    assert RequestFraming(10_000, 100).advance(request_bytes) is Progress.READY


def test_a_body_over_the_limit_is_handed_over_after_one_byte_more():
    over = HEAD + b"Content-Length: 1000\r\n\r\n"
    framing = RequestFraming(10_000, 100)
    assert framing.advance(over + b"x" * 100) is Progress.BODY
    assert framing.advance(over + b"x" * 101) is Progress.READY
    chunked = RequestFraming(10_000, 100)
    assert chunked.advance(CHUNKED + b"200\r\n" + b"x" * 100) is Progress.BODY
    assert chunked.advance(CHUNKED + b"200\r\n" + b"x" * 101) is Progress.READY


def test_head_waits_then_is_too_large():
    framing = RequestFraming(max_head_bytes=100, max_body_bytes=100)
    assert framing.advance(b"GET / HTTP/1.1\r\nX: " + b"a" * 50) is Progress.HEAD
    assert framing.advance(b"GET / HTTP/1.1\r\nX: " + b"a" * 200) is \
        Progress.HEAD_TOO_LARGE


def test_expect_continue_is_seen_on_http11_only():
    framing = RequestFraming(10_000, 100)
    framing.advance(HEAD + b"Expect: 100-Continue\r\nContent-Length: 3\r\n\r\n")
    assert framing.expects_continue
    old = RequestFraming(10_000, 100)
    old.advance(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
    assert not old.expects_continue
