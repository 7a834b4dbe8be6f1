"""llama-server's CORS forms (issue 34, item 6), through real gunicorn:
``--cors-origins localhost`` (any page on this machine, its origin
reflected), ``--cors-methods``, ``--cors-headers`` and
``--cors-credentials``. Before, ``localhost`` was taken for a literal origin
that no browser sends, so it allowed nothing, and the other three flags did
not exist.

The safe defaults are those of issue 29 (no grant without a key, ``*``
without credentials with keys); a real browser's view of them is in
``tests/test_cors_browser.py``.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

KEY = "sk-cors-forms"
TIMEOUT_S = 60

localhost_pages = pool_fixture(workers=1, frontend_env={
    "LLAMAPOOL_CORS_ORIGINS": "localhost"})
credentialed = pool_fixture(workers=1, api_keys=(KEY,), frontend_env={
    "LLAMAPOOL_CORS_ORIGINS": "https://app.example",
    "LLAMAPOOL_CORS_CREDENTIALS": "1",
    "LLAMAPOOL_CORS_METHODS": "GET,POST",
    "LLAMAPOOL_CORS_HEADERS": "Authorization,Content-Type"})
keyed_default = pool_fixture(workers=1, api_keys=(KEY,))


def preflight(pool, origin: str, asked_headers: str = "content-type"):
    return httpx.options(pool.url + "/v1/completions", timeout=TIMEOUT_S, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked_headers})


def complete(pool, origin: str, **headers):
    return httpx.post(pool.url + "/v1/completions", timeout=TIMEOUT_S,
                      headers={"Origin": origin, **headers},
                      json={"prompt": "Hi", "max_tokens": 2})


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000",
                                    "http://[::1]:8000"])
def test_localhost_reflects_any_page_on_this_machine(localhost_pages, origin):
    r = preflight(localhost_pages, origin)
    assert r.headers.get("access-control-allow-origin") == origin
    assert "origin" in r.headers.get("vary", "").lower()
    answer = complete(localhost_pages, origin)
    assert answer.status_code == 200
    assert answer.headers.get("access-control-allow-origin") == origin
    assert "access-control-allow-credentials" not in answer.headers


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost.evil.example"])
def test_localhost_keeps_other_pages_out(localhost_pages, origin):
    assert "access-control-allow-origin" not in preflight(localhost_pages, origin).headers
    r = complete(localhost_pages, origin)
    assert r.status_code == 403, r.text
    assert "access-control-allow-origin" not in r.headers


def test_credentials_methods_and_headers_as_configured(credentialed):
    r = preflight(credentialed, "https://app.example", "authorization,x-other")
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST"
    assert r.headers["access-control-allow-headers"] == "Authorization, Content-Type"
    answer = complete(credentialed, "https://app.example",
                      Authorization=f"Bearer {KEY}")
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-credentials"] == "true"
    assert answer.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in preflight(
        credentialed, "https://other.example").headers


def test_the_keyed_default_is_star_without_credentials(keyed_default):
    r = preflight(keyed_default, "https://any.example", "authorization")
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers
    # The route's methods, and the headers the page asked for.
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization"
