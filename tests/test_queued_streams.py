"""A streamed request that waits for a slot sees that it waits, and the keys
file is read again on SIGHUP (issue 31, items 5 and 6), through real
gunicorn, a real broker and one worker on the tiny GGUF.

Before, a streamed job the broker queued (``--queue-max``) got nothing at
all until its slot came: no headers, no bytes, so a proxy timed it out and
its client saw no progress. Now it is answered at once and gets SSE comment
lines, ``: waiting, position N``, again whenever its place moves up; the
OpenAI and Anthropic SDKs ignore them. A wait that ends past its deadline
ends the stream with an error event (the status was sent).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import signal
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests import test_web_page
from tests.pool import wait_until
from tests.pool_factory import PoolOptions, pool_fixture
from tests.test_slot_paths import hold_slot
from tests.test_waiting_room_pool import KEY_A, KEY_B, auth, waiting

pytestmark = pytest.mark.stack

#: The real browser the page's tests drive (``tests/test_web_page.py``).
browser = test_web_page.browser

TIMEOUT_S = 120

#: As ``tests/test_waiting_room_pool.py``'s: the same pool, handed on.
queued_pool = pool_fixture(workers=1, api_keys=(KEY_A, KEY_B),
                           broker_args=("--queue-max", "8", "--queue-timeout-s", "60"))


@pytest.fixture
def clients():
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


class Lines:
    """A streamed completion's lines, read as they come."""

    def __init__(self, pool, key: str, headers: dict | None = None) -> None:
        self._client = httpx.Client(timeout=TIMEOUT_S)
        self._cm = self._client.stream(
            "POST", pool.url + "/v1/completions",
            headers={**auth(key), **(headers or {})},
            json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True,
                  "stream": True})
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines()
        self.seen: list[str] = []

    def until(self, wanted) -> str:
        """Read up to (and return) the first line for which ``wanted`` holds."""
        for line in self._lines:
            self.seen.append(line)
            if wanted(line):
                return line
        raise AssertionError(f"the stream ended first: {self.seen}")

    def rest(self) -> list[str]:
        self.seen += list(self._lines)
        return self.seen

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self._client.close()


def test_a_queued_stream_is_told_its_place_and_when_it_moves_up(queued_pool):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    first = second = None
    try:
        first = Lines(queued_pool, KEY_A)
        assert first.response.status_code == 200  # answered while it waits
        assert first.until(lambda line: line.startswith(":")) == (
            ": waiting, position 1")
        second = Lines(queued_pool, KEY_B)
        assert second.until(bool) == ": waiting, position 2"
        # The first waiter leaves: the broker tells the second its new place.
        first.close()
        first = None
        assert second.until(lambda line: "position 1" in line) == (
            ": waiting, position 1")
        held.close()
        held = None
        lines = second.rest()
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        for stream in (first, second, held):
            if stream is not None:
                stream.close()
    queued_pool.wait_free(1, 30)


def test_a_stream_whose_wait_passes_its_deadline_ends_with_an_error_event(
        queued_pool):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    try:
        stream = Lines(queued_pool, KEY_B, headers={"X-Max-Wait-S": "1"})
        try:
            assert stream.response.status_code == 200
            lines = stream.rest()
        finally:
            stream.close()
    finally:
        held.close()
    assert lines[0] == ": waiting, position 1"
    errors = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(errors) == 1 and "data: [DONE]" not in lines
    error = errors[0]["error"]
    assert error["code"] == "no_slot" and error["status"] == 503
    assert "retry after" in error["message"]
    queued_pool.wait_free(1, 30)


def test_the_openai_client_streams_through_a_wait(queued_pool, clients):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    client = openai.OpenAI(base_url=queued_pool.url + "/v1", api_key=KEY_B,
                           max_retries=0, timeout=TIMEOUT_S)
    try:
        # The headers come at once: the SDK hands out the stream while the
        # job still waits, and reads the comments as nothing.
        stream = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4, stream=True, extra_body={"ignore_eos": True})
        wait_until(lambda: waiting(queued_pool) == 1, 30, "the request to wait")
        reading = clients.submit(list, stream)
        held.close()
        held = None
        chunks = reading.result(timeout=TIMEOUT_S)
    finally:
        if held is not None:
            held.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"
    queued_pool.wait_free(1, 30)


def test_the_anthropic_client_streams_through_a_wait(queued_pool, clients):
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    client = anthropic.Anthropic(base_url=queued_pool.url, api_key=KEY_B,
                                 max_retries=0, timeout=TIMEOUT_S)

    def read():
        with client.messages.stream(
                model="any", max_tokens=4,
                messages=[{"role": "user", "content": "Hi"}]) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    try:
        reading = clients.submit(read)
        wait_until(lambda: waiting(queued_pool) == 1, 30, "the request to wait")
        held.close()
        held = None
        text, final = reading.result(timeout=TIMEOUT_S)
    finally:
        if held is not None:
            held.close()
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.output_tokens >= 1
    queued_pool.wait_free(1, 30)


# --- the keys file on SIGHUP -----------------------------------------------------

KEY_LIMITED = "sk-hup-limited-0123456789"
KEY_OLD, KEY_NEW = "sk-hup-old-0123456789", "sk-hup-new-0123456789"


def entry(name: str, key: str, **limits) -> str:
    lines = ["[[key]]", f'name = "{name}"',
             f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
    lines += [f"{field} = {value}" for field, value in limits.items()]
    return "\n".join(lines) + "\n\n"


BEFORE = entry("team-a", KEY_LIMITED, max_slots=1) + entry("team-b", KEY_OLD)
AFTER = entry("team-a", KEY_LIMITED, max_slots=2) + entry("team-b", KEY_NEW)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hup") / "keys.toml"
    path.write_text(BEFORE)
    return path


@pytest.fixture(scope="module")
def hup_pool(pool_factory, keys_file):
    options = PoolOptions(workers=1, frontend_env={
        "LLAMAPOOL_KEYS_FILE": str(keys_file)})
    with pool_factory(options, private=True) as running:
        yield running


def status(pool, key: str) -> int:
    return httpx.post(pool.url + "/v1/completions", headers=auth(key),
                      json={"prompt": "Hi", "max_tokens": 2},
                      timeout=TIMEOUT_S).status_code


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def test_sighup_reads_the_keys_file_again(hup_pool, keys_file):
    assert status(hup_pool, KEY_OLD) == 200 and status(hup_pool, KEY_NEW) == 401
    held, _ = hold_slot(hup_pool, headers=auth(KEY_LIMITED))
    try:
        assert status(hup_pool, KEY_LIMITED) == 429  # over its one slot
    finally:
        held.close()
    hup_pool.wait_free(1, 30)
    # The same size and modification time: only SIGHUP can tell it changed
    # (a change is otherwise seen by its stamp, within a second).
    stamp = os.stat(keys_file)
    assert len(AFTER) == len(BEFORE)
    keys_file.write_text(AFTER)
    os.utime(keys_file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    after = os.stat(keys_file)
    assert (after.st_mtime_ns, after.st_size) == (stamp.st_mtime_ns, stamp.st_size)
    # To gunicorn's master (``llamapool frontend`` execs it): it starts
    # fresh workers, which read the file, and stops the old ones.
    master = hup_pool.frontend.pid
    old = children(master)
    os.kill(master, signal.SIGHUP)
    wait_until(lambda: len(children(master) - old) == len(old)
               and not children(master) & old, 60, "gunicorn's fresh workers")
    assert status(hup_pool, KEY_NEW) == 200
    assert status(hup_pool, KEY_OLD) == 401
    # Its new limit: a second job is the full pool's 503, not the key's 429.
    held, _ = hold_slot(hup_pool, headers=auth(KEY_LIMITED))
    try:
        assert status(hup_pool, KEY_LIMITED) == 503
    finally:
        held.close()
    hup_pool.wait_free(1, 30)


# --- the web page shows the place in line ------------------------------------------


def test_the_web_page_shows_the_place_in_line(queued_pool, browser):
    page = test_web_page  # its helpers
    d = browser
    d.get(queued_pool.url + "/")
    d.execute_script("localStorage.clear();"
                     "localStorage.setItem('llamapool.apiKey', arguments[0])", KEY_B)
    d.get(queued_pool.url + "/")
    page.wait_for(d, "document.documentElement.dataset.ready === 'true'")
    page.set_setting(d, "set-max-tokens", 8)
    held, _ = hold_slot(queued_pool, headers=auth(KEY_A))
    try:
        page.type_and_enter(d, "Are you there?")
        page.wait_for(d, "document.getElementById('status').textContent"
                         ".includes('position 1 in the queue')")
        assert d.execute_script(
            "return document.getElementById('status').dataset.kind") == "busy"
        assert waiting(queued_pool) == 1
    finally:
        held.close()
    page.wait_for(d, "document.getElementById('status').textContent"
                     ".startsWith('Done')")
    queued_pool.wait_free(1, 30)


#: Waits end after 2 s; a held slot is given up after 8 s without reading
#: (which bounds the Retry-After the page counts down).
short_wait_pool = pool_fixture(
    workers=1, api_keys=(KEY_A, KEY_B), worker_args=("--stall-timeout-s", "8"),
    broker_args=("--queue-max", "8", "--queue-timeout-s", "2"))


def test_the_web_page_tries_again_after_a_wait_that_ran_out(short_wait_pool,
                                                            browser):
    page = test_web_page
    d = browser
    d.get(short_wait_pool.url + "/")
    d.execute_script("localStorage.clear();"
                     "localStorage.setItem('llamapool.apiKey', arguments[0])", KEY_B)
    d.get(short_wait_pool.url + "/")
    page.wait_for(d, "document.documentElement.dataset.ready === 'true'")
    page.set_setting(d, "set-max-tokens", 8)
    held, _ = hold_slot(short_wait_pool, headers=auth(KEY_A))
    try:
        page.type_and_enter(d, "Are you there?")
        page.wait_for(d, "document.getElementById('status').textContent"
                         ".includes('in the queue')")
        # The wait ran out in the stream (its 200 was sent): the page counts
        # down as for a 503, then asks again.
        page.wait_for(d, "document.getElementById('status').textContent"
                         ".includes('Retrying in')")
    finally:
        held.close()
    page.wait_for(d, "document.getElementById('status').textContent"
                     ".startsWith('Done')")
    short_wait_pool.wait_free(1, 30)
