"""CORS: a real browser page on another origin calls the API (issue 11, section 3).

A keyed pool and Debian's headless ``chromium`` (as ``tests/test_web_page.py``
drives it). The page is served by a second local HTTP server, on another
port, which makes it another origin: every ``fetch`` with an
``Authorization`` header is preceded by a CORS preflight (``OPTIONS``) that
the browser sends without the key. Before the fix the preflight got 401
and no ``Access-Control-*`` header, so the browser refused every call.
"""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from tests.pool_factory import pool_fixture
from tests.system_tools import require_tool

pytestmark = pytest.mark.stack

KEY = "sk-cors-7Hq2-browser-key-0951"
BROWSER_WAIT_S = 60.0
PAGE = b"<!doctype html><title>another origin</title><p>calling the API</p>"


class _PageServer:
    """A second origin: one static page on its own port."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(PAGE)))
                self.end_headers()
                self.wfile.write(PAGE)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def page_servers():
    servers = [_PageServer(), _PageServer()]
    yield servers
    for s in servers:
        s.close()


#: Default CORS: any origin, as llama.cpp's ``--cors-origins *``.
open_pool = pool_fixture(workers=1, api_keys=(KEY,))


@pytest.fixture(scope="module")
def restricted_pool(pool_factory, page_servers):
    """Only the first page server's origin is allowed."""
    with pool_factory(workers=1, api_keys=(KEY,), frontend_env={
            "LLAMAPOOL_CORS_ORIGINS": page_servers[0].origin}) as p:
        yield p


@pytest.fixture(scope="module")
def browser():
    chromium = require_tool("chromium")
    chromedriver = require_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--disable-extensions",
                "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver),
                              options=options)
    driver.set_script_timeout(BROWSER_WAIT_S)
    yield driver
    driver.quit()


#: Runs in the page: one fetch, its status, readable headers and body (a
#: stream is read to its end), or the error a blocked call raises.
FETCH_JS = """
const [url, key, body, done] = [arguments[0], arguments[1], arguments[2],
                                arguments[arguments.length - 1]];
const headers = {"Content-Type": "application/json"};
if (key) headers["Authorization"] = "Bearer " + key;
fetch(url, {method: "POST", headers, body: JSON.stringify(body)})
  .then(async (r) => {
    let text = "";
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const {value, done: end} = await reader.read();
      if (end) break;
      text += decoder.decode(value, {stream: true});
    }
    done({status: r.status, slot: r.headers.get("X-Slot-Id"),
          request_id: r.headers.get("X-Request-Id"),
          type: r.headers.get("Content-Type"), text});
  })
  .catch((e) => done({error: String(e)}));
"""


def call_from_page(browser, page_origin: str, api: str, body: dict,
                   key: str | None = KEY) -> dict:
    if not browser.current_url.startswith(page_origin):
        browser.get(page_origin + "/")
    return browser.execute_async_script(FETCH_JS, api, key, body)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "ignore_eos": True}


def test_preflight_is_answered_without_a_key(open_pool):
    r = httpx.options(open_pool.url + "/v1/chat/completions", headers={
        "Origin": "http://elsewhere.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"},
        timeout=30)
    assert r.status_code in (200, 204), r.text
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    # The key is still needed for the call itself, and the 401 is readable.
    r = httpx.post(open_pool.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": "http://elsewhere.example"}, timeout=30)
    assert r.status_code == 401
    assert r.headers["Access-Control-Allow-Origin"] == "*"


def test_a_page_on_another_origin_chats_whole_and_streamed(
        open_pool, browser, page_servers):
    page = page_servers[1].origin
    api = open_pool.url + "/v1/chat/completions"
    whole = call_from_page(browser, page, api, CHAT)
    assert whole.get("status") == 200, whole
    assert whole["slot"] is not None and whole["request_id"]  # exposed headers
    assert "chat.completion" in whole["text"]
    streamed = call_from_page(browser, page, api, {**CHAT, "stream": True})
    assert streamed.get("status") == 200, streamed
    assert streamed["type"].startswith("text/event-stream")
    assert '"role":"assistant"' in streamed["text"]
    assert streamed["text"].rstrip().endswith("data: [DONE]")
    # Without the key the page sees the 401 itself, not a network error.
    refused = call_from_page(browser, page, api, CHAT, key=None)
    assert refused.get("status") == 401, refused
    assert "Invalid API Key" in refused["text"]
    open_pool.assert_whole()


def test_a_disallowed_origin_is_blocked_and_an_allowed_one_is_not(
        restricted_pool, browser, page_servers):
    allowed, other = page_servers[0].origin, page_servers[1].origin
    api = restricted_pool.url + "/v1/chat/completions"
    before = restricted_pool.status()["counters"].get("submitted", 0)
    blocked = call_from_page(browser, other, api, CHAT)
    assert "error" in blocked and "Failed to fetch" in blocked["error"], blocked
    # The browser stopped at the preflight: the request never took a slot.
    assert restricted_pool.status()["counters"].get("submitted", 0) == before
    ok = call_from_page(browser, allowed, api, {**CHAT, "stream": True})
    assert ok.get("status") == 200, ok
    assert ok["text"].rstrip().endswith("data: [DONE]")
    r = httpx.options(api, headers={"Origin": other,
                                    "Access-Control-Request-Method": "POST"},
                      timeout=30)
    assert "Access-Control-Allow-Origin" not in r.headers
    r = httpx.options(api, headers={"Origin": allowed,
                                    "Access-Control-Request-Method": "POST"},
                      timeout=30)
    assert r.headers["Access-Control-Allow-Origin"] == allowed
    restricted_pool.assert_whole()
