"""API keys and bad input, through real gunicorn.

Bad input gets a clear error, never reaches a worker, and never takes a slot:
the broker's ``submitted`` counter must not move.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from frontend.web_page import PAGE_FILES
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

KEY = "sk-test-Zq81-unique-key-7731"
INVALID = {"error": {"message": "Invalid API Key", "type": "authentication_error"}}
PUBLIC = ["/health", "/v1/health", "/models", "/v1/models", "/", "/index.html",
          "/bundle.js", "/bundle.css"]


keyed_pool = pool_fixture(workers=1, api_keys=(KEY, "second-key"),
                          frontend_env={"LLAMAPOOL_MAX_BODY_BYTES": "65536"})


def _post(pool, headers=None, **kw):
    kw.setdefault("json", {"prompt": "Hi", "max_tokens": 2})
    return httpx.post(pool.url + "/v1/completions", headers=headers or {}, **kw)


# --- auth --------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {KEY}"},
    {"X-Api-Key": "wrong"},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {KEY}x"},
])
def test_missing_or_bad_key_gets_401(keyed_pool, headers):
    r = _post(keyed_pool, headers)
    assert r.status_code == 401
    assert r.json() == INVALID


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEY}"},
    {"authorization": f"bearer {KEY}"},
    {"X-Api-Key": KEY},
    {"Authorization": "Bearer second-key"},
])
def test_good_key_in_either_header(keyed_pool, headers):
    r = _post(keyed_pool, headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", PUBLIC)
def test_public_endpoints_need_no_key(keyed_pool, path):
    r = httpx.get(keyed_pool.url + path)
    assert r.status_code == 200, r.text


def test_slots_is_protected(keyed_pool):
    assert httpx.get(keyed_pool.url + "/slots").status_code == 401
    r = httpx.get(keyed_pool.url + "/slots", headers={"X-Api-Key": KEY})
    assert r.status_code == 200 and len(r.json()) == 1


def test_openai_client_with_key(keyed_pool):
    client = openai.OpenAI(base_url=keyed_pool.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).usage
    bad = openai.OpenAI(base_url=keyed_pool.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="Hi", max_tokens=2)


def test_key_never_logged(keyed_pool):
    _post(keyed_pool, {"X-Api-Key": KEY})
    _post(keyed_pool, {"X-Api-Key": "wrong-key-abcdef"})
    logs = keyed_pool.logs()
    assert KEY not in logs and "wrong-key-abcdef" not in logs
    assert KEY[-4:] in keyed_pool.frontend.log()  # the startup line's suffix


# --- bad input ---------------------------------------------------------------------

AUTH = {"X-Api-Key": KEY}


# Each refused field of the two generation endpoints, and malformed JSON: in
# process, in tests/test_frontend_inproc.py. Through real gunicorn: the
# hostile bodies below (a 400 naming the field, no job) and
# tests/test_request_fuzz.py (never a 5xx).


def test_prompt_longer_than_context_names_the_reason(keyed_pool):
    before = keyed_pool.status()["counters"].get("submitted", 0)
    r = _post(keyed_pool, AUTH, json={"prompt": "Hello " * 3000})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # llama.cpp's type for it (tests/test_llama_details.py checks the rest).
    assert (error["type"], error["param"]) == ("exceed_context_size_error",
                                               "prompt")
    assert keyed_pool.status()["counters"].get("submitted", 0) == before
    r = httpx.post(keyed_pool.url + "/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "world " * 3000}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_oversized_body_is_413(keyed_pool):
    before = keyed_pool.status()["counters"].get("submitted", 0)
    r = _post(keyed_pool, AUTH, json={"prompt": "x" * 70000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert keyed_pool.status()["counters"].get("submitted", 0) == before


def test_garbage_http_does_not_hurt(keyed_pool):
    """Broken request lines and headers: the server answers and stays up."""
    for raw in [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: "
                b"zz\r\n\r\n", b"\x00\x01\x02\r\n\r\n"]:
        with socket.create_connection(("127.0.0.1", keyed_pool.port), timeout=5) as s:
            s.sendall(raw)
            s.recv(1024)
    assert _post(keyed_pool, AUTH).status_code == 200
    keyed_pool.assert_whole()


def test_unknown_route_and_method(keyed_pool):
    assert httpx.get(keyed_pool.url + "/v1/nothing", headers=AUTH).status_code == 404
    r = httpx.get(keyed_pool.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


# --- bodies that once got a 500 and a traceback (issue 10, item 11) -----------------

DEEP = b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
HUGE_INT = b"1" + b"0" * 400  # 10**400: valid JSON, beyond any wire integer


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", DEEP, None),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ' + HUGE_INT + b"}",
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": ' + HUGE_INT + b"}",
     "temperature"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": ["\\udfff"]}', "stop[0]"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": ["user"], "content": "x"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": {"a": 1}, "content": "x"}]}',
     "messages[0].role"),
], ids=["nested-2000", "max_tokens-10e400", "temperature-10e400", "surrogate-prompt",
        "surrogate-stop", "surrogate-content", "role-list", "role-object"])
def test_hostile_body_is_400_not_500(keyed_pool, path, raw, param):
    before = keyed_pool.status()["counters"].get("submitted", 0)
    r = httpx.post(keyed_pool.url + path, content=raw,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error.get("param") == param
    assert "Traceback" not in keyed_pool.frontend.log()
    assert keyed_pool.status()["counters"].get("submitted", 0) == before


def test_metric_labels_come_from_routes_not_raw_paths(keyed_pool):
    """Unique paths, refused (401) or unknown (404), add no series (issue 10,
    item 9): the label is the route template, or ``other``."""
    marker = "zz-unique-path-marker"
    for i in range(50):
        httpx.get(f"{keyed_pool.url}/{marker}/{i}")  # 401: refused before routing
        httpx.get(f"{keyed_pool.url}/{marker}/{i}", headers=AUTH)  # 404
    _post(keyed_pool, AUTH)
    text = httpx.get(keyed_pool.url + "/metrics", headers=AUTH).text
    assert marker not in text
    labels = set(re.findall(r'llamapool_http_responses_total\{endpoint="([^"]*)"',
                            text))
    assert "/v1/completions" in labels and "other" in labels
    assert labels <= {"other", "/metrics", "/slots", *PAGE_FILES, *(
        f"{prefix}/{name}" for prefix in ("", "/v1")
        for name in ("completions", "chat/completions", "models", "health"))}


def _chunks(data: bytes, size: int = 1000):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_chunked_body_is_read(keyed_pool):
    """A body sent with Transfer-Encoding: chunked (no Content-Length) is read,
    bounded by the same limit (issue 10, item 12)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    r = httpx.post(keyed_pool.url + "/v1/completions", content=_chunks(body, 7),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    before = keyed_pool.status()["counters"].get("submitted", 0)
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    r = httpx.post(keyed_pool.url + "/v1/completions", content=_chunks(big, 65536),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert keyed_pool.status()["counters"].get("submitted", 0) == before


def test_health_flood_costs_the_broker_few_status_requests(keyed_pool):
    """Unauthenticated /health checks are answered from a ledger at most
    LLAMAPOOL_HEALTH_CACHE_S (0.25 s) old (issue 10, item 14)."""
    def asked() -> int:
        return keyed_pool.status()["counters"].get("status_requests", 0)

    before = asked()
    started = time.monotonic()
    with httpx.Client() as client:
        for _ in range(300):
            assert client.get(keyed_pool.url + "/health").status_code == 200
    elapsed = time.monotonic() - started
    by_frontend = asked() - before - 1  # the probe's own second STATUS
    # Each of gunicorn's 2 processes asks at most once per 0.25 s.
    assert by_frontend <= 2 * (elapsed / 0.25 + 1), (by_frontend, elapsed)
