"""The web page at ``/``, through real processes and a real browser.

A keyed pool (broker, 2 workers with the tiny model, gunicorn) and Debian's
``chromium`` driven through the system ``/usr/bin/chromedriver`` (Selenium;
nothing downloads a browser). Every wait is on a condition with a generous
deadline: the machine is small and shared.

Screenshots of the chat and of the pool view are saved under the test's
temporary directory. With ``LLAMAPOOL_WEB_SCREENSHOTS=DIR`` they are also
written to ``DIR``; ``LLAMAPOOL_WEB_SCREENSHOTS=frontend/web/screenshots``
refreshes the README's (that folder is not package data).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from frontend.web_page import PAGE_FILES, WEB_DIR
from tests.pool import TEST_HEARTBEAT, Pool, Proc, cli, wait_until
from tests.pool_factory import pool_fixture
from tests.system_tools import require_tool

pytestmark = pytest.mark.stack

KEY = "sk-web-Pq72-page-key-4410"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Long enough to be stopped mid-way: the tiny model's context is 2048.
LONG_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000,
             "ignore_eos": True, "stream": True}
BROWSER_WAIT_S = 60.0


#: A client that stops reading holds its slot at most this long; it also caps
#: the Retry-After the broker computes for such a slot (the busy-pool test's
#: countdown), which the default (60 s) would make a minute long.
STALL_TIMEOUT_S = 8


web_pool = pool_fixture(workers=2, api_keys=(KEY,),
                        worker_args=("--stall-timeout-s", str(STALL_TIMEOUT_S)))


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium through the system chromedriver."""
    chromium = require_tool("chromium")
    chromedriver = require_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--window-size=1280,800",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver),
                              options=options)
    driver.set_script_timeout(BROWSER_WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture
def page(web_pool, browser):
    """The page freshly opened, with an empty browser storage."""
    browser.set_window_size(1280, 800)
    emulate(browser, "light")
    slow_network(browser, bytes_per_s=-1)  # -1: no limit
    browser.get(web_pool.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(web_pool.url + "/")
    wait_for(browser, "document.documentElement.dataset.ready === 'true'")
    yield browser
    # No console errors but the API's own refusals (the 401s the page handles).
    errors = [e for e in browser.get_log("browser")
              if e["level"] == "SEVERE" and "401" not in e["message"]
              and "503" not in e["message"]]
    assert not errors, errors
    browser.execute_script("window.llamapool?.chat.stop()")
    web_pool.assert_whole(timeout_s=30)


def wait_for(driver, js_condition: str, timeout_s: float = BROWSER_WAIT_S):
    """Wait until a JavaScript expression is truthy in the page; return it."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(
        lambda d: d.execute_script(f"return {js_condition}"),
        message=f"waiting for {js_condition}")


def emulate(driver, scheme: str) -> None:
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": scheme}]})


def slow_network(driver, bytes_per_s: int) -> None:
    """Deliver responses to the page at most this fast (Chromium's network
    emulation), until the next ``page`` fixture resets it."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": False, "latency": 0,
        "downloadThroughput": bytes_per_s, "uploadThroughput": -1})


def with_key(driver, pool: Pool) -> None:
    driver.execute_script("localStorage.setItem('llamapool.apiKey', arguments[0])", KEY)
    driver.get(pool.url + "/")
    wait_for(driver, "document.documentElement.dataset.ready === 'true'")


def set_setting(driver, element_id: str, value) -> None:
    driver.execute_script(
        "const el = document.getElementById(arguments[0]);"
        "if (el.type === 'checkbox') el.checked = arguments[1];"
        "else el.value = arguments[1];"
        "el.dispatchEvent(new Event('change'));", element_id, value)


def type_and_enter(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text, Keys.ENTER)


def status_text(driver) -> str:
    return driver.execute_script("return document.getElementById('status').textContent")


def save_screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a real picture, not an empty frame
    target = os.environ.get("LLAMAPOOL_WEB_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / name)
    return path


def slots(pool: Pool) -> list[dict]:
    return httpx.get(pool.url + "/slots", headers=AUTH, timeout=10).json()


# --- the files, over plain HTTP ----------------------------------------------------


def test_every_page_file_is_listed_and_shipped():
    """Each file in frontend/web is served, and each served file exists (the
    README's screenshots folder beside them is not part of the page)."""
    on_disk = {p.name for p in WEB_DIR.iterdir() if p.is_file()}
    assert on_disk == set(PAGE_FILES.values())


@pytest.mark.parametrize("path,content_type", [
    ("/", "text/html"), ("/index.html", "text/html"),
    ("/bundle.js", "text/javascript"), ("/bundle.css", "text/css"),
    ("/web/chat.js", "text/javascript"), ("/web/markdown.js", "text/javascript"),
])
def test_page_files_are_public_typed_cached_and_locked_down(web_pool, path,
                                                            content_type):
    r = httpx.get(web_pool.url + path)  # no key, on a pool that has keys
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(content_type)
    assert r.headers["x-content-type-options"] == "nosniff"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["cache-control"] == "no-cache"
    etag = r.headers["etag"]
    again = httpx.get(web_pool.url + path, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    stale = httpx.get(web_pool.url + path, headers={"If-None-Match": '"old"'})
    assert stale.status_code == 200 and stale.content == r.content
    assert httpx.head(web_pool.url + path).status_code == 200


def test_api_stays_protected_and_other_paths_are_not_public(web_pool):
    assert httpx.get(web_pool.url + "/slots").status_code == 401
    assert httpx.get(web_pool.url + "/metrics").status_code == 401
    assert httpx.get(web_pool.url + "/web/../auth.py").status_code in (401, 404)
    assert httpx.get(web_pool.url + "/web/missing.js").status_code == 401
    r = httpx.get(web_pool.url + "/web/missing.js", headers=AUTH)
    assert r.status_code == 404


# --- in the browser -----------------------------------------------------------------


def test_asks_for_the_key_after_a_401_then_streams(page, web_pool, tmp_path):
    """Issue 12, test 1: no key needed for the page; the key form appears on
    the first 401; then the answer streams in, growing before it ends."""
    from selenium.webdriver.common.by import By

    d = page
    wait_for(d, "!document.getElementById('key-form').hidden")
    # The tiny model can write 400 tokens faster than the page paints once
    # (it paints on animation frames), and a loaded machine may deliver the
    # whole stream in one read. A slow network spreads the stream over
    # seconds, as a real one would, so "seen growing" does not hang on
    # timing.
    slow_network(d, bytes_per_s=24_000)
    set_setting(d, "set-max-tokens", 400)
    set_setting(d, "set-ignore-eos", True)
    # Record the answer's length at every DOM change while it streams.
    d.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const el = document.querySelector('.message.assistant.streaming .body');
          if (el) window.__lengths.push(el.textContent.length);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});
    """)
    type_and_enter(d, "Tell me a story")
    wait_for(d, "document.getElementById('status').textContent"
                ".includes('needs an API key')")
    d.find_element(By.ID, "key-input").send_keys(KEY)
    d.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait_for(d, "document.getElementById('status').textContent.startsWith('Done')")
    assert "400 tokens" in status_text(d)
    assert d.execute_script("return localStorage.getItem('llamapool.apiKey')") == KEY
    growth = [n for n in d.execute_script("return window.__lengths") if n > 0]
    assert len(set(growth)) >= 2, growth  # seen growing, not only at the end
    print(f"painted {len(set(growth))} lengths while streaming")
    assert growth == sorted(growth)
    answer = d.execute_script(
        "return document.querySelector('.message.assistant .body').textContent")
    assert len(answer) > max(growth[:1] or [0])
    # The conversation is kept in the browser and listed.
    stored = d.execute_script(
        "return JSON.parse(localStorage.getItem('llamapool.conversations'))")
    assert stored[0]["title"] == "Tell me a story"
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    save_screenshot(d, tmp_path, "web-chat.png")


def test_stop_ends_the_stream_and_frees_the_slot(page, web_pool):
    """Issue 12, test 2: Esc during a long answer aborts the stream; the slot
    is idle in /slots at once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = page
    with_key(d, web_pool)
    set_setting(d, "set-max-tokens", 2000)
    set_setting(d, "set-ignore-eos", True)
    type_and_enter(d, "Go on for a long time")
    wait_for(d, "document.querySelector('.message.assistant.streaming .body')"
                "?.textContent.length > 0")
    d.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    stopped_at = time.monotonic()
    wait_for(d, "document.getElementById('status').textContent.startsWith('Stopped')")
    wait_until(lambda: all(s["state"] == "idle" for s in slots(web_pool)), 30,
               "every slot idle in /slots after Stop", interval_s=0.05)
    freed_after_s = time.monotonic() - stopped_at
    print(f"slot idle in /slots {freed_after_s:.3f} s after Stop")
    # Stopped mid-way: the partial answer is kept and marked, well short of 2000.
    assert d.execute_script("return document.getElementById('stop').disabled")
    stored = d.execute_script(
        "return JSON.parse(localStorage.getItem('llamapool.conversations'))")
    answer = stored[0]["messages"][-1]
    assert answer["role"] == "assistant" and answer["stopped"] is True
    done = httpx.get(web_pool.url + "/metrics", headers=AUTH).text
    assert "llamapool_requests_cancelled_total" in done
    # Generous for a loaded 2-core machine; typically well under a second.
    assert freed_after_s < 5.0, freed_after_s


def hold_slot(pool: Pool, held: list, ready: threading.Event,
              release: threading.Event) -> threading.Thread:
    """A client streaming a long answer that holds its slot until ``release``
    (it stops reading: the worker pauses, the slot stays taken)."""

    def run() -> None:
        with httpx.stream("POST", pool.url + "/v1/chat/completions", headers=AUTH,
                          json=LONG_CHAT, timeout=60) as r:
            held.append(r.status_code)
            ready.set()
            release.wait(120)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_busy_pool_shows_a_countdown_then_succeeds(page, web_pool, tmp_path):
    """Issue 12, test 3: both slots held by other clients: the page shows the
    busy message with a countdown, and the answer comes once they are gone."""
    d = page
    with_key(d, web_pool)
    set_setting(d, "set-max-tokens", 20)
    held: list[int] = []
    release = threading.Event()
    holders = []
    for _ in range(2):
        ready = threading.Event()
        holders.append(hold_slot(web_pool, held, ready, release))
        assert ready.wait(30)
    try:
        assert held == [200, 200]
        wait_until(lambda: all(s["is_processing"] for s in slots(web_pool)), 30,
                   "both slots busy")
        type_and_enter(d, "Are you there?")
        wait_for(d, "document.getElementById('status').dataset.kind === 'busy'")
        message = status_text(d)
        assert "All slots are busy" in message and "Retrying in" in message, message
        save_screenshot(d, tmp_path, "web-busy.png")
        # The countdown counts: the number shown changes (or a new try starts).
        wait_for(d, f"document.getElementById('status').textContent !== {message!r}")
    finally:
        release.set()
        for t in holders:
            t.join(60)
    wait_for(d, "document.getElementById('status').textContent.startsWith('Done')")
    assert d.execute_script(
        "return document.querySelector('.message.assistant .body').textContent.length"
    ) > 0


EVIL = ("Here: <script>window.xssRan = 1</script> and "
        "<img src=x onerror=\"window.xssRan = 2\"> "
        "[click](javascript:window.xssRan=3) **bold** `<b>code</b>`\n\n"
        "```\n<iframe src=\"/\"></iframe>\n```")


def assert_rendered_as_text(d, root_js: str) -> None:
    found = d.execute_script(f"""
        const root = {root_js};
        return {{
          bad: root.querySelectorAll('script, img, iframe, b, [onerror]').length,
          jsLinks: [...root.querySelectorAll('a')].filter(
              a => !/^https?:|^mailto:/.test(a.getAttribute('href') || '')).length,
          strong: root.querySelectorAll('strong').length,
          text: root.textContent,
          pwned: window.xssRan ?? null,
        }};""")
    assert found["bad"] == 0 and found["jsLinks"] == 0, found
    assert found["pwned"] is None, found
    assert "<script>window.xssRan = 1</script>" in found["text"]
    assert "<img src=x onerror=" in found["text"]
    assert "<b>code</b>" in found["text"]
    assert '<iframe src="/"></iframe>' in found["text"]
    assert found["strong"] == 1  # Markdown still works around it


def test_model_output_with_html_is_shown_as_text(page, web_pool):
    """Issue 12, test 4, the renderer alone: the page's own Markdown module
    (what each streamed delta goes through), and a stored conversation the
    page renders when it loads. The real model's answer is the next test."""
    d = page
    d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import('/web/markdown.js').then(({renderMarkdown}) => {
          const box = document.createElement('div');
          box.id = 'evil-box';
          box.append(renderMarkdown(arguments[0]));
          document.body.append(box);
          setTimeout(done, 200);  // time for an onerror to fire, were it there
        });""", EVIL)
    assert_rendered_as_text(d, "document.getElementById('evil-box')")

    conversation = {"id": "evil", "title": "evil", "updated": 1,
                    "messages": [{"role": "user", "content": "<b>hi</b>"},
                                 {"role": "assistant", "content": EVIL}]}
    d.execute_script("localStorage.setItem('llamapool.conversations',"
                     " JSON.stringify([arguments[0]]))", conversation)
    d.get(web_pool.url + "/")
    wait_for(d, "document.querySelectorAll('.message').length === 2")
    d.execute_script("return new Promise(r => setTimeout(r, 200))")
    assert_rendered_as_text(d, "document.getElementById('messages')")


def gbnf_literal(text: str) -> str:
    """A GBNF grammar whose only sentence is ``text``."""
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"')
               .replace("\n", "\\n"))
    return f'root ::= "{escaped}"'


def test_a_real_model_answer_with_html_is_shown_as_text(page, web_pool):
    """Issue 12, test 4, end to end: the real model, forced by a grammar (the
    page's request gets a ``grammar`` field added in the browser), streams an
    answer holding <script>, <img onerror>, a javascript: link and an
    <iframe> through the real pool into the real page."""
    d = page
    with_key(d, web_pool)
    d.execute_script("""
        const grammar = arguments[0];
        const realFetch = window.fetch;
        window.fetch = (url, init) => {
          if (String(url).endsWith('/v1/chat/completions') && init?.body) {
            init = {...init, body: JSON.stringify(
                {...JSON.parse(init.body), grammar})};
          }
          return realFetch(url, init);
        };""", gbnf_literal(EVIL))
    set_setting(d, "set-max-tokens", 1000)
    set_setting(d, "set-ignore-eos", False)
    type_and_enter(d, "Show me some HTML")
    wait_for(d, "document.getElementById('status').textContent.startsWith('Done')")
    answer = d.execute_script(
        "return document.querySelector('.message.assistant .body').textContent")
    assert "<script>window.xssRan = 1</script>" in answer, answer
    d.execute_script("return new Promise(r => setTimeout(r, 200))")  # onerror time
    assert_rendered_as_text(d, "document.getElementById('messages')")


def test_pool_view_lists_every_slot_and_shows_a_busy_one(page, web_pool, tmp_path):
    """Issue 12, test 5 (and the pool screenshot, test 6)."""
    from selenium.webdriver.common.by import By

    d = page
    with_key(d, web_pool)
    d.find_element(By.ID, "tab-pool").click()
    wait_for(d, "document.querySelectorAll('#slots tbody tr').length === 2")
    pids = {str(w.pid) for w in web_pool.workers}
    shown = d.execute_script(
        "return [...document.querySelectorAll('#slots tbody tr td:nth-child(4)')]"
        ".map(td => td.textContent)")
    assert set(shown) == pids
    held: list[int] = []
    ready, release = threading.Event(), threading.Event()
    holder = hold_slot(web_pool, held, ready, release)
    try:
        assert ready.wait(30) and held == [200]
        wait_for(d, "document.querySelectorAll("
                    "'#slots tbody tr[data-state=busy]').length === 1")
        wait_for(d, "document.querySelector('#slots tbody tr[data-state=busy]"
                    " td:nth-child(8)').textContent.trim() !== ''")
        summary = d.find_element(By.ID, "pool-summary").text
        assert summary == "2 slots, 1 busy", summary
        # The lease age, by the broker's clock (/slots' lease_age_s).
        busy = next(s for s in slots(web_pool) if s["is_processing"])
        assert busy["lease_age_s"] > 0
        wait_for(d, "/^\\d+\\.\\d s$/.test(document.querySelector("
                    "'#slots tbody tr[data-state=busy] td:nth-child(10)').textContent)")
        # Another client's answer, read to its end: the live tokens/s figure
        # and the sparkline (sampled once a second) show it.
        with httpx.stream("POST", web_pool.url + "/v1/chat/completions",
                          headers=AUTH, json=LONG_CHAT, timeout=60) as r:
            for _ in r.iter_bytes():
                pass
        # The pool's totals count a job when it ends (the broker's FINAL).
        wait_for(d, "Number(document.querySelector("
                    "'dd[data-name=\"tokens generated\"]')"
                    ".textContent.replace(/\\D/g, '')) >= 2000")
        wait_for(d, "window.llamapool.pool.rates.length >= 5")
        points = d.execute_script("return document.querySelector("
                                  "'#sparkline polyline').getAttribute('points')")
        assert len(points.split()) >= 5
        save_screenshot(d, tmp_path, "web-pool.png")
    finally:
        release.set()
        holder.join(60)
    wait_for(d, "document.querySelectorAll("
                "'#slots tbody tr[data-state=idle]').length === 2")


def test_keyboard_phone_width_and_dark_theme(page, web_pool, tmp_path):
    """Shift+Enter is a new line (Enter sends, Esc stops: tests above); a
    phone-width window needs no sideways scrolling; the theme follows the
    system's setting."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = page
    with_key(d, web_pool)
    box = d.find_element(By.ID, "prompt")
    box.send_keys("line one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "line two")
    assert box.get_property("value") == "line one\nline two"
    assert d.execute_script("return document.querySelectorAll('.message').length") == 0

    light = d.execute_script("return getComputedStyle(document.body).backgroundColor")
    emulate(d, "dark")
    dark = wait_for(d, "getComputedStyle(document.body).backgroundColor !== "
                       f"{light!r} && getComputedStyle(document.body).backgroundColor")
    assert light == "rgb(255, 255, 255)" and dark == "rgb(22, 24, 28)"

    d.set_window_size(390, 844)
    wait_for(d, "window.innerWidth <= 400")
    for view in ("chat", "pool"):
        d.find_element(By.ID, f"tab-{view}").click()
        overflow = d.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, (view, overflow)
    wait_for(d, "document.querySelectorAll('#slots tbody tr').length === 2")
    save_screenshot(d, tmp_path, "web-phone-dark.png")


def test_markdown_structure(page):
    """The renderer still renders Markdown: headings, lists, code, emphasis,
    safe links, and leaves snake_case words alone."""
    text = ("# Title\n- one\n- two\n\n1. first\n\nfoo_bar_baz and *it* and "
            "**bold** [site](https://example.com/x)\n\n> quoted\n\n```py\nx = 1\n```")
    found = page.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import('/web/markdown.js').then(({renderMarkdown}) => {
          const box = document.createElement('div');
          box.append(renderMarkdown(arguments[0]));
          done({
            tags: [...box.children].map(e => e.tagName),
            items: box.querySelectorAll('li').length,
            em: [...box.querySelectorAll('em')].map(e => e.textContent),
            href: box.querySelector('a').getAttribute('href'),
            rel: box.querySelector('a').rel,
            code: box.querySelector('pre code').textContent,
            text: box.textContent,
          });
        });""", text)
    assert found["tags"] == ["H3", "UL", "OL", "P", "BLOCKQUOTE", "PRE"], found
    assert found["items"] == 3 and found["em"] == ["it"]
    assert "foo_bar_baz" in found["text"]
    assert found["href"] == "https://example.com/x" and "noopener" in found["rel"]
    assert found["code"] == "x = 1"


def test_pool_view_shows_a_failing_worker_and_why(page, web_pool):
    """Issue 27: a worker its supervisor holds after a crash loop (the
    stand-in ``llamapool up`` starts, ``LLAMAPOOL_HELD``) is listed as
    failed, with the failure, in the error colour."""
    from selenium.webdriver.common.by import By

    failure = "worker-9 held after 5 crashes in a row; last: killed by SIGSEGV"
    held = Proc("held-worker", cli(
        "worker", "--broker", web_pool.workers_ep, "--model",
        str(web_pool.model_path), *TEST_HEARTBEAT), web_pool.run_dir,
        env={**os.environ, "LLAMAPOOL_HELD": "1", "LLAMAPOOL_LAST_FAILURE": failure})
    try:
        d = page
        with_key(d, web_pool)
        d.find_element(By.ID, "tab-pool").click()
        wait_for(d, "document.querySelectorAll("
                    "'#slots tbody tr[data-state=failed]').length === 1")
        cell = d.find_element(By.CSS_SELECTOR,
                              "#slots tbody tr[data-state=failed] td.state")
        assert cell.text == f"failed: {failure}"
        assert "failing" in cell.get_attribute("class").split()
        # Red: the page's --error colour, not the text's.
        assert cell.value_of_css_property("color") != d.find_element(
            By.CSS_SELECTOR, "#slots tbody tr[data-state=idle] td.state"
        ).value_of_css_property("color")
        # /health (200: the two real workers serve) lists it too.
        assert httpx.get(web_pool.url + "/health").json()["failing"][0][
            "failure"] == failure
    finally:
        held.stop()
    wait_for(page, "document.querySelectorAll("
                   "'#slots tbody tr[data-state=failed]').length === 0")
