"""Named API keys with limits (issue 31, item 5), through real gunicorn, a
real broker and one worker on the tiny GGUF.

A keys file gives each key a name, its SHA-256 and limits. A key over a
limit gets 429 with Retry-After and ``x-ratelimit-*``, enforced at the
broker; the pool being full stays 503; the file is read again when it
changes; the broker counts each key's tokens, requests and refusals by
name, exactly, and never shows a key.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from pathlib import Path

import httpx
import pytest

from tests.pool import scrape_metrics, wait_until
from tests.pool_factory import PoolOptions
from tests.test_slot_paths import hold_slot

pytestmark = pytest.mark.stack

KEY_A, KEY_B, KEY_C, KEY_D = (f"sk-named-{n}-0123456789" for n in "abcd")
PLAIN = "sk-plain-key-9876"
TIMEOUT_S = 120


def entry(name: str, key: str, **limits) -> str:
    lines = ["[[key]]", f'name = "{name}"',
             f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
    lines += [f"{field} = {value}" for field, value in limits.items()]
    return "\n".join(lines) + "\n\n"


FIRST_FILE = (entry("team-a", KEY_A, max_slots=1)
              + entry("team-b", KEY_B, tokens_per_minute=40)
              + entry("team-c", KEY_C, max_queued=1))


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(FIRST_FILE)
    return path


@pytest.fixture(scope="module")
def pool(pool_factory, keys_file):
    options = PoolOptions(
        workers=1, api_keys=(PLAIN,),
        frontend_env={"LLAMAPOOL_KEYS_FILE": str(keys_file)},
        broker_args=("--queue-max", "8", "--queue-timeout-s", "60"))
    with pool_factory(options, private=True) as running:
        yield running


@pytest.fixture
def clients():
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(pool, key: str, prompt: str = "Hi", max_tokens: int = 4,
             headers: dict | None = None) -> httpx.Response:
    return httpx.post(pool.url + "/v1/completions", timeout=TIMEOUT_S,
                      headers={**auth(key), **(headers or {})},
                      json={"prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True})


def scrape(pool) -> dict:
    return scrape_metrics(pool.url, auth(PLAIN), TIMEOUT_S)


def metric(pool, name: str, **labels) -> float:
    return scrape(pool).get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_key_over_its_slots_is_429_and_a_full_pool_stays_503(pool, clients):
    held, _ = hold_slot(pool, headers=auth(KEY_A))
    try:
        over = complete(pool, KEY_A)
        assert over.status_code == 429, over.text
        body = over.json()["error"]
        assert body["code"] == "rate_limit_exceeded" and "1 jobs running" in body["message"]
        assert int(over.headers["Retry-After"]) >= 1
        assert over.headers["x-ratelimit-limit-requests"] == "1"
        assert over.headers["x-ratelimit-remaining-requests"] == "0"
        # Another key is not limited by A's limit: it waits for the slot, and
        # a wait that runs out is the pool's 503, not a 429.
        full = complete(pool, PLAIN, headers={"X-Max-Wait-S": "0.5"})
        assert full.status_code == 503 and "Retry-After" in full.headers
    finally:
        held.close()
    pool.wait_free(1, 30)
    assert complete(pool, KEY_A).status_code == 200
    assert metric(pool, "llamapool_key_refusals_total", key="team-a",
                  reason="slots") == 1


def test_a_key_over_its_waiting_jobs_is_429(pool, clients):
    held, _ = hold_slot(pool, headers=auth(PLAIN))
    try:
        first = clients.submit(complete, pool, KEY_C)
        wait_until(lambda: metric(pool, "llamapool_key_jobs", key="team-c",
                                  state="waiting") == 1, 30, "team-c's job waiting")
        queue = httpx.get(pool.url + "/queue", headers=auth(PLAIN), timeout=30).json()
        assert queue["waiting"] == 1
        assert {"key": "team-c", "waiting": 1, "running": 0} in queue["keys"]
        second = complete(pool, KEY_C)
        assert second.status_code == 429, second.text
        assert "1 jobs waiting" in second.json()["error"]["message"]
        assert second.headers["x-ratelimit-limit-requests"] == "1"
    finally:
        held.close()
    assert first.result(timeout=TIMEOUT_S).status_code == 200
    pool.wait_free(1, 30)


def test_tokens_per_minute_and_exact_usage_counters(pool):
    # team-b may use 40 tokens a minute: requests of a few prompt tokens and
    # 8 generated tokens pass until the window holds 40 or more.
    answered = []
    for _ in range(10):
        r = complete(pool, KEY_B, prompt="Count the sheep", max_tokens=8)
        if r.status_code != 200:
            break
        answered.append(r.json()["usage"])
    assert r.status_code == 429, r.text
    assert 2 <= len(answered) < 10
    spent = sum(u["prompt_tokens"] + u["completion_tokens"] for u in answered)
    assert spent >= 40 or spent + answered[0]["prompt_tokens"] > 40
    assert r.headers["x-ratelimit-limit-tokens"] == "40"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == max(0, 40 - spent)
    assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    # The broker's counts, by name, exactly what the answers said.
    assert metric(pool, "llamapool_key_requests_total", key="team-b") == len(answered)
    assert metric(pool, "llamapool_key_prompt_tokens_total", key="team-b") == sum(
        u["prompt_tokens"] for u in answered)
    assert metric(pool, "llamapool_key_completion_tokens_total", key="team-b") == sum(
        u["completion_tokens"] for u in answered)
    assert metric(pool, "llamapool_key_refusals_total", key="team-b",
                  reason="tokens") == 1
    # Names only: no key, nor its hash, is in any series.
    text = httpx.get(pool.url + "/metrics", headers=auth(PLAIN), timeout=30).text
    for secret in (KEY_B, hashlib.sha256(KEY_B.encode()).hexdigest()):
        assert secret not in text


def test_the_keys_file_is_read_again_when_it_changes(pool, keys_file):
    assert complete(pool, KEY_D).status_code == 401
    write_atomically(keys_file, FIRST_FILE + entry("team-d", KEY_D))
    wait_until(lambda: complete(pool, KEY_D).status_code == 200, 30,
               "the new key accepted")
    # A file that no longer parses keeps what was read before: a key of
    # every version stays served while frontend processes read the broken
    # one (each gunicorn process reads the file on its own).
    write_atomically(keys_file, FIRST_FILE + "[[key]]\nname = 'broken'\n")

    def still_served_after_the_broken_read() -> bool:
        assert complete(pool, KEY_A).status_code == 200
        return "keys file not reloaded" in pool.frontend.log()

    wait_until(still_served_after_the_broken_read, 30, "the broken file read")
    assert complete(pool, KEY_A).status_code == 200
    # A key taken out is refused.
    write_atomically(keys_file, entry("team-b", KEY_B))
    wait_until(lambda: complete(pool, KEY_A).status_code == 401, 30,
               "the removed key refused")
    # --api-key keeps working beside the file.
    assert complete(pool, PLAIN).status_code == 200
