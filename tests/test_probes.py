"""Liveness apart from readiness, the exec probes, and the demand metric,
on real processes (issue 35).

One private pool that starts with no worker: the frontend must be alive
and not ready; a worker (with its ``--metrics-port``) makes it ready; a
broker stopped makes it unready and leaves it, and the worker, alive.
"""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from tests.pool import cli, free_port, wait_until
from tests.pool_factory import PoolOptions

pytestmark = pytest.mark.stack

MODEL = "tiny-demand"
#: 100 s of synthetic tokens: busy until the stream is closed.
LONG = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def ports():
    return {"broker": free_port(), "worker": free_port()}


@pytest.fixture(scope="module")
def empty_pool(pool_factory, ports):
    options = PoolOptions(
        workers=0, wait_ready=False,
        broker_args=("--metrics-port", str(ports["broker"])),
        frontend_env={"LLAMAPOOL_MODEL_NAME": MODEL},
        worker_env={"LLAMAPOOL_MODEL_NAME": MODEL})
    with pool_factory(options, private=True) as pool:
        wait_until(lambda: status(pool, "/livez") == 200, 60, "gunicorn up")
        yield pool


def status(pool, path: str) -> int | None:
    try:
        return httpx.get(pool.url + path, timeout=2).status_code
    except httpx.HTTPError:
        return None


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli("probe", *args), capture_output=True, text=True,
                          timeout=30)


def probe_ok(*args: str) -> bool:
    return probe(*args).returncode == 0


def test_no_worker_alive_but_not_ready(empty_pool, ports):
    assert status(empty_pool, "/livez") == 200
    readyz = httpx.get(empty_pool.url + "/readyz", timeout=5)
    assert readyz.status_code == 503
    assert readyz.json()["error"]["message"] == "no worker is ready"
    # /health keeps llama-server's meaning: 503 while no model is loaded.
    assert status(empty_pool, "/health") == 503
    # The broker's loop beats; it holds no loaded slot yet.
    wait_until(lambda: probe_ok("broker", "--port", str(ports["broker"])), 30,
               "the broker's first published ledger")
    refused = probe("broker", "--port", str(ports["broker"]), "--min-slots", "1")
    assert refused.returncode == 1 and "0 loaded slots" in refused.stdout


def test_probe_of_nothing_listening_fails():
    result = probe("worker", "--port", str(free_port()), "--timeout-s", "1")
    assert result.returncode == 1 and result.stdout.startswith("not ok:")


def test_a_registered_worker_makes_it_ready(empty_pool, ports):
    # The synthetic engine at 20 tokens/s: a stream holds its slot for as
    # long as the refusal test needs, whatever the socket buffers take.
    empty_pool.worker_args = ("--metrics-port", str(ports["worker"]),
                              "--engine", "synthetic", "--tokens-per-second", "20")
    empty_pool.start_worker()
    port = str(ports["worker"])
    wait_until(lambda: probe_ok("worker", "--port", port, "--require",
                                "registered"), 60, "the worker registered")
    assert probe_ok("worker", "--port", port, "--require", "loaded")
    assert probe_ok("worker", "--port", port)  # alive
    wait_until(lambda: status(empty_pool, "/readyz") == 200, 15, "/readyz 200")
    body = httpx.get(empty_pool.url + "/readyz", timeout=5).json()
    assert body["status"] == "ready" and body["slots_ready"] == 1
    assert status(empty_pool, "/livez") == 200
    assert probe_ok("broker", "--port", str(ports["broker"]), "--min-slots", "1")


def test_refusals_are_counted_per_model(empty_pool):
    def refused_count() -> float:
        text = httpx.get(empty_pool.url + "/metrics", timeout=5).text
        match = re.search(r'^llamapool_requests_refused_no_slot_total\{model="'
                          + MODEL + r'"\} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    before = refused_count()
    with httpx.stream("POST", empty_pool.url + "/v1/completions", json=LONG,
                      timeout=30) as held:
        assert held.status_code == 200
        # Generating; the rest is left unread. The iterator is kept: a
        # temporary one, finalized at once, closes the connection under it
        # (httpcore closes its stream on GeneratorExit), and the job then
        # ended as a disconnect within a few tokens, so the slot showed busy
        # only for as long as the scrape below happened to catch.
        lines = held.iter_lines()
        next(lines)
        refused = httpx.post(empty_pool.url + "/v1/completions",
                             json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        # The slot is taken; both states count as busy (the KEDA query too).
        # Polled: a scrape whose STATUS the broker does not answer within
        # --health-timeout-s (1 s, a loaded machine) has no pool series.
        wait_until(lambda: re.search(
            r'^llamapool_model_slots\{model="' + MODEL
            + r'",state="(busy|cancelling)"\} 1\.0$',
            httpx.get(empty_pool.url + "/metrics", timeout=5).text, re.M), 30,
            "the held slot busy in llamapool_model_slots")
    assert refused_count() == before + 1
    empty_pool.assert_whole()


def test_broker_gone_unready_but_alive(empty_pool, ports):
    port = str(ports["worker"])
    empty_pool.broker.stop()
    wait_until(lambda: status(empty_pool, "/readyz") == 503, 15, "/readyz 503")
    wait_until(lambda: not probe_ok("worker", "--port", port, "--require",
                                    "registered"), 15, "the worker unregistered")
    # Neither is restarted for it: both still answer their liveness checks.
    assert status(empty_pool, "/livez") == 200
    assert probe_ok("worker", "--port", port, "--require", "alive")
    assert not probe_ok("broker", "--port", str(ports["broker"]), "--timeout-s", "1")
    empty_pool.restart_broker()
    wait_until(lambda: probe_ok("worker", "--port", port, "--require",
                                "registered"), 30, "the worker registered again")
    wait_until(lambda: status(empty_pool, "/readyz") == 200, 15, "/readyz 200")
