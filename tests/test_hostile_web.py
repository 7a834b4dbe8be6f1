"""Web pages against a keyless pool (issue 29, item 3), in a real browser.

A keyless pool (``llamapool up``, ``make serve``) used to send
``Access-Control-Allow-Origin: *``: a page served from another origin, in
headless Chromium, read a chat answer, ``/slots``, ``/props`` (with the
model file's absolute path) and ``/metrics``; a request with ``Host:
rebind.example`` was served, so a DNS-rebinding page was same-origin with
the pool, and even a restricted ``--cors-origins`` list did not keep it out.

Here, through real gunicorn and Debian's ``chromium`` (driven as in
``tests/test_cors_browser.py``):

* a page on another origin (a second local HTTP server) can read nothing
  from a keyless pool, and its "simple" ``POST``, which a browser sends
  without asking first, runs no job (the broker's ``submitted`` count);
* an origin named in ``--cors-origins`` still can;
* a DNS-rebinding page: Chromium is told that ``rebind.example`` is
  127.0.0.1 (``--host-resolver-rules``), opens ``http://rebind.example:PORT/``
  and fetches ``/slots`` same-origin; the pool answers 421, with or without
  a ``--cors-origins`` list; raw ``httpx`` requests with a forged ``Host``
  too, while loopback names and addresses are served;
* ``/props`` names the model file, not its path.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pool import Pool
from tests.pool_factory import pool_fixture
from tests.system_tools import require_tool
from tests.test_cors_browser import _PageServer

pytestmark = pytest.mark.stack

BROWSER_WAIT_S = 60.0
REBIND = "rebind.example"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "ignore_eos": True}

#: The keyless pool ``llamapool up`` starts: no key, no --cors-origins.
keyless_pool = pool_fixture(workers=1)


@pytest.fixture(scope="module")
def page_servers():
    servers = [_PageServer(), _PageServer()]
    yield servers
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def listed_pool(pool_factory, page_servers):
    """Keyless, with only the first page server's origin allowed."""
    with pool_factory(workers=1, frontend_env={
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
                "--no-first-run",
                # The rebinding: the attacker's name now resolves to the pool.
                f"--host-resolver-rules=MAP {REBIND} 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver),
                              options=options)
    driver.set_script_timeout(BROWSER_WAIT_S)
    yield driver
    driver.quit()


#: Runs in the page: one fetch, its status and body, or the error a blocked
#: call raises. ``mode`` "no-cors" sends a simple request whose answer the
#: page may not read (an opaque response): only its sending counts.
FETCH_JS = """
const [url, method, body, mode, done] = [arguments[0], arguments[1],
    arguments[2], arguments[3], arguments[arguments.length - 1]];
const init = {method, mode};
if (body !== null) {
  init.body = JSON.stringify(body);
  init.headers = {"Content-Type": mode === "no-cors" ? "text/plain"
                                                     : "application/json"};
}
fetch(url, init)
  .then(async (r) => done({status: r.status, type: r.type,
                           text: await r.text()}))
  .catch((e) => done({error: String(e)}));
"""


def fetch_from(browser, page_url: str, url: str, method: str = "GET",
               body: dict | None = None, mode: str = "cors") -> dict:
    """``fetch(url)`` run by a page loaded from ``page_url``."""
    if browser.current_url != page_url:
        browser.get(page_url)
    return browser.execute_async_script(FETCH_JS, url, method, body, mode)


def submitted(pool: Pool) -> int:
    return pool.status()["counters"].get("submitted", 0)


def blocked(result: dict) -> bool:
    """The browser refused the call: the page got an error, not an answer."""
    return "error" in result and "Failed to fetch" in result["error"]


def test_a_page_on_another_origin_can_read_nothing_of_a_keyless_pool(
        keyless_pool, browser, page_servers):
    page = page_servers[1].origin + "/"
    api = keyless_pool.url
    for path in ("/slots", "/props", "/metrics", "/health"):
        result = fetch_from(browser, page, api + path)
        assert blocked(result), (path, result)
    result = fetch_from(browser, page, api + "/v1/chat/completions", "POST", CHAT)
    assert blocked(result), result
    keyless_pool.assert_whole()


def test_a_simple_post_from_another_origin_runs_no_job(
        keyless_pool, browser, page_servers):
    """CORS only hides answers: a text/plain POST is sent without a
    preflight. It is refused (403) before anything runs."""
    page = page_servers[1].origin + "/"
    before = submitted(keyless_pool)
    result = fetch_from(browser, page, keyless_pool.url + "/v1/chat/completions",
                        "POST", CHAT, mode="no-cors")
    assert result.get("type") == "opaque", result  # sent, its answer hidden
    assert submitted(keyless_pool) == before
    # The same request without the browser's Origin (curl, a script) runs.
    r = httpx.post(keyless_pool.url + "/v1/chat/completions", json=CHAT,
                   timeout=60)
    assert r.status_code == 200, r.text
    assert "Access-Control-Allow-Origin" not in r.headers
    r = httpx.post(keyless_pool.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": page_servers[1].origin}, timeout=60)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "origin_not_allowed"
    assert "--cors-origins" in r.json()["error"]["message"]
    keyless_pool.assert_whole()


def test_the_pools_own_page_still_chats(keyless_pool, browser):
    """Same-origin calls (the pool's web page) carry an Origin too."""
    page = keyless_pool.url + "/"
    result = fetch_from(browser, page, "/v1/chat/completions", "POST", CHAT)
    assert result.get("status") == 200, result
    assert "chat.completion" in result["text"]
    keyless_pool.assert_whole()


def test_an_origin_given_in_cors_origins_may_use_a_keyless_pool(
        listed_pool, browser, page_servers):
    listed, other = (s.origin + "/" for s in page_servers)
    api = listed_pool.url + "/v1/chat/completions"
    ok = fetch_from(browser, listed, api, "POST", {**CHAT, "stream": True})
    assert ok.get("status") == 200, ok
    assert ok["text"].rstrip().endswith("data: [DONE]")
    assert fetch_from(browser, listed, listed_pool.url + "/slots")["status"] == 200
    assert blocked(fetch_from(browser, other, api, "POST", CHAT))
    assert blocked(fetch_from(browser, other, listed_pool.url + "/slots"))
    listed_pool.assert_whole()


@pytest.mark.parametrize("which", ["keyless", "listed"])
def test_a_dns_rebinding_page_is_answered_421(which, keyless_pool, listed_pool,
                                              browser):
    pool = keyless_pool if which == "keyless" else listed_pool
    page = f"http://{REBIND}:{pool.port}/"
    # The page itself is the pool's answer: the browser sees one origin.
    result = fetch_from(browser, page, "/slots")
    assert result.get("status") == 421, result
    error = httpx.Response(421, content=result["text"]).json()["error"]
    assert error["code"] == "misdirected_request"
    assert REBIND in error["message"] and "--allowed-hosts" in error["message"]
    before = submitted(pool)
    result = fetch_from(browser, page, "/v1/chat/completions", "POST", CHAT)
    assert result.get("status") == 421, result
    assert submitted(pool) == before
    pool.assert_whole()


@pytest.mark.parametrize("host", [REBIND, f"{REBIND}:8080", "attacker.example.",
                                  "127.0.0.1.nip.io", "localhost.attacker.example"])
def test_a_forged_host_is_refused(keyless_pool, host):
    for method, path in (("GET", "/slots"), ("GET", "/props"), ("GET", "/"),
                         ("POST", "/v1/completions")):
        r = httpx.request(method, keyless_pool.url + path, headers={"Host": host},
                          json={"prompt": "a", "max_tokens": 1}
                          if method == "POST" else None, timeout=30)
        assert r.status_code == 421, (path, r.text)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}",
                                  "app.localhost:{port}", "[::1]:{port}", "10.9.8.7"])
def test_loopback_names_and_addresses_are_served(keyless_pool, host):
    host = host.format(port=keyless_pool.port)
    r = httpx.get(keyless_pool.url + "/slots", headers={"Host": host}, timeout=30)
    assert r.status_code == 200, r.text


def test_props_names_the_model_file_not_its_path(keyless_pool):
    props = httpx.get(keyless_pool.url + "/props", timeout=30).json()
    assert props["model_path"] == keyless_pool.model_path.name
    assert "/" not in props["model_path"]
