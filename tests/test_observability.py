"""What operators see: /metrics, /slots, /health and logs, through real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.pool import Proc, cli, free_port, wait_until
from tests.pool_factory import pool_fixture
from tests.system_tools import require_tool
from tests.test_slot_paths import LONG, RawStream, hold_slot, wait_paused

pytestmark = pytest.mark.stack

KEY = "sk-observe-9Qx2-KEYSECRET"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET_PROMPT = "purple-elephant-prompt-31337"
#: The ``model`` label of the pool's model-scoped series: the workers' model,
#: named after its file (issue 30).
MODEL = "tiny.gguf"


opool = pool_fixture(workers=2, api_keys=(KEY,), global_args=("--log-format", "json"),
                     frontend_env={"LLAMAPOOL_MAX_BODY_BYTES": "4096"})


def scrape(pool) -> dict:
    r = httpx.get(pool.url + "/metrics", headers=AUTH)
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before, after, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_needs_the_key(opool):
    assert httpx.get(opool.url + "/metrics").status_code == 401


def test_counters_move_by_exact_amounts(opool):
    before = scrape(opool)
    prompt_n = completion_n = 0
    prompt_s = tokens_s = 0.0
    for i in range(3):
        r = httpx.post(opool.url + "/v1/completions", headers=AUTH, json={
            "prompt": f"Hello world {i}", "max_tokens": 7, "ignore_eos": True})
        timings = r.json()["timings"]
        prompt_n += timings["prompt_n"]
        completion_n += timings["predicted_n"]
        prompt_s += timings["prompt_ms"] / 1000
        tokens_s += timings["predicted_ms"] / 1000
    with httpx.stream("POST", opool.url + "/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    usage = json.loads(events[-2])["usage"]
    timings = json.loads(events[-3])["timings"]
    prompt_n += timings["prompt_n"]
    completion_n += usage["completion_tokens"]
    prompt_s += timings["prompt_ms"] / 1000
    tokens_s += timings["predicted_ms"] / 1000
    # Rejections, one of each reason.
    assert httpx.post(opool.url + "/v1/completions", json={}).status_code == 401
    assert httpx.post(opool.url + "/v1/completions", headers=AUTH,
                      json={"prompt": 1}).status_code == 400
    assert httpx.post(opool.url + "/v1/completions", headers=AUTH,
                      json={"prompt": "x" * 5000}).status_code == 413
    streams = [RawStream(opool.port, LONG, headers=AUTH) for _ in range(2)]
    for s in streams:
        wait_paused(opool, int(s.header("X-Slot-Id")))
    assert httpx.post(opool.url + "/v1/completions", headers=AUTH,
                      json={"prompt": "Hi"}).status_code == 503
    for s in streams:
        s.close()
    opool.assert_whole()

    after = scrape(opool)
    assert delta(before, after, "llama_request_success_total", model=MODEL) == 4
    assert delta(before, after, "llama_tokens_generated_total",
                 model=MODEL) >= completion_n
    assert delta(before, after, "llamapool_requests_cancelled_total", model=MODEL) == 2
    # The two cancelled streams generated tokens too; everything else is exact.
    assert delta(before, after, "llama_prompt_tokens_total", model=MODEL) >= prompt_n
    assert delta(before, after, "llama_prompt_seconds_total",
                 model=MODEL) >= prompt_s * 0.999
    assert delta(before, after, "llama_tokens_seconds_total",
                 model=MODEL) >= tokens_s * 0.999
    assert delta(before, after, "llama_request_fail_total", model=MODEL) == 0
    for reason in ("auth", "bad_request", "too_large", "no_slot"):
        assert delta(before, after, "llamapool_requests_rejected_total",
                     reason=reason) == 1, reason
    assert delta(before, after, "llamapool_broker_no_slot_total", model=MODEL) == 1
    assert delta(before, after, "llamapool_disconnect_release_seconds_count",
                 model=MODEL) == 2
    assert delta(before, after, "llamapool_time_to_first_token_seconds_count",
                 model=MODEL) == 6
    assert delta(before, after, "llamapool_slot_hold_seconds_count", model=MODEL) == 7
    assert delta(before, after, "llamapool_inter_token_latency_seconds_count",
                 model=MODEL) > 20
    # Every request that reached the broker, the refused one included.
    assert delta(before, after, "llamapool_request_duration_seconds_count",
                 model=MODEL) == 7
    assert value(after, "llamapool_slots_registered", model=MODEL) == 2
    assert value(after, "llama_slots_processing", model=MODEL) == 0


def test_exact_token_counts_without_cancels(opool):
    """Every llama_* counter moves by exactly what the responses report."""
    before = scrape(opool)
    timings = []
    for n in (3, 5):
        r = httpx.post(opool.url + "/v1/completions", headers=AUTH,
                       json={"prompt": f"Hi there {n}", "max_tokens": n,
                             "ignore_eos": True})
        timings.append(r.json()["timings"])
    after = scrape(opool)
    assert delta(before, after, "llama_tokens_generated_total", model=MODEL) == 8
    assert delta(before, after, "llama_request_success_total", model=MODEL) == 2
    assert delta(before, after, "llama_request_fail_total", model=MODEL) == 0
    assert delta(before, after, "llama_prompt_tokens_total", model=MODEL) == sum(
        t["prompt_n"] for t in timings)
    assert abs(delta(before, after, "llama_prompt_seconds_total", model=MODEL)
               - sum(t["prompt_ms"] for t in timings) / 1000) < 1e-6
    assert abs(delta(before, after, "llama_tokens_seconds_total", model=MODEL)
               - sum(t["predicted_ms"] for t in timings) / 1000) < 1e-6


def test_worker_death_restart_and_fail_counters(opool):
    before = scrape(opool)
    stream, slot_id = hold_slot(opool, headers=AUTH)
    pid = next(s["pid"] for s in opool.status()["slots"] if s["id"] == slot_id)
    os.kill(pid, signal.SIGKILL)
    victim = next(w for w in opool.workers if w.pid == pid)
    victim.popen.wait(timeout=10)
    stream.read_to_end()
    stream.close()
    opool.workers.remove(victim)
    opool.start_worker()
    opool.wait_free(2, timeout_s=30)
    after = scrape(opool)
    assert delta(before, after, "llama_request_fail_total", model=MODEL) == 1
    assert delta(before, after, "llamapool_worker_deaths_total") == 1
    assert delta(before, after, "llamapool_worker_restarts_total") == 1


def test_malformed_frames_are_counted(opool):
    before = scrape(opool)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(opool.frontends_ep)
    sock.send_multipart([b"junk", b"\x01", b"\xc1"])
    sock.send(b"single frame of garbage")
    wait_until(lambda: delta(before, scrape(opool),
                             "llamapool_broker_malformed_frames_dropped_total") == 2,
               10, "the broker to count 2 malformed messages")
    sock.close(0)
    ctx.term()


def test_promtool_accepts_real_output(opool):
    promtool = require_tool("promtool")  # Debian package prometheus
    httpx.post(opool.url + "/v1/completions", headers=AUTH,
               json={"prompt": "Hi", "max_tokens": 2})
    text = httpx.get(opool.url + "/metrics", headers=AUTH).text
    result = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                            capture_output=True)
    # llama.cpp's own series keep its names, colon and all (a dashboard made
    # for llama-server reads them); promtool's linter reserves colons for
    # recording rules and wants "_total" on every counter, which llama.cpp's
    # n_tokens_max lacks. That is all it may say.
    problems = [line for line in (result.stdout + result.stderr).decode()
                .splitlines() if line.strip()]
    llamacpp = [p for p in problems if p.startswith("llamacpp:") and (
        p.endswith("metric names should not contain ':'")
        or p == 'llamacpp:n_tokens_max counter metrics should have "_total" suffix')]
    assert problems == llamacpp, problems
    assert llamacpp  # they are there


def test_slots_show_busy_while_a_stream_is_held(opool):
    stream, slot_id = hold_slot(opool, headers=AUTH)
    slots = httpx.get(opool.url + "/slots", headers=AUTH).json()
    busy = next(s for s in slots if s["id"] == slot_id)
    assert busy["state"] == "busy" and busy["is_processing"]
    assert busy["id_task"] and busy["n_decoded"] > 0 and busy["kv_cache_tokens"] > 0
    assert busy["lease_taken_at"] is not None and busy["n_ctx"] == 2048
    assert busy["model"] == "tiny.gguf" and busy["pid"] > 0
    idle = [s for s in slots if s["id"] != slot_id]
    assert [s["state"] for s in idle] == ["idle"]
    assert SECRET_PROMPT not in json.dumps(slots)
    stream.close()
    opool.assert_whole()
    slots = httpx.get(opool.url + "/slots", headers=AUTH).json()
    assert {s["state"] for s in slots} == {"idle"}


def test_request_id_round_trip(opool):
    r = httpx.get(opool.url + "/health", headers={"X-Request-Id": "abc-123.x"})
    assert r.headers["X-Request-Id"] == "abc-123.x"
    r = httpx.get(opool.url + "/health", headers={"X-Request-Id": "bad id\twith junk"})
    assert r.headers["X-Request-Id"] != "bad id\twith junk"
    assert len(r.headers["X-Request-Id"]) == 32


def test_logs_are_json_lines_without_secrets_or_prompts(opool):
    httpx.post(opool.url + "/v1/completions",
               headers={**AUTH, "X-Request-Id": "logtest-1"},
               json={"prompt": SECRET_PROMPT, "max_tokens": 3})
    httpx.post(opool.url + "/v1/completions",
               headers={"X-Api-Key": "wrong-" + KEY, "X-Request-Id": "logtest-2"},
               json={"prompt": SECRET_PROMPT})

    def request_lines():
        lines = []
        for line in opool.frontend.log().splitlines():
            if line.startswith("{") and '"llamapool.request"' in line:
                lines.append(json.loads(line))
        ids = {entry["request_id"] for entry in lines}
        return lines if {"logtest-1", "logtest-2"} <= ids else None

    lines = wait_until(request_lines, 10, "both request log lines")
    ok = next(e for e in lines if e["request_id"] == "logtest-1")
    assert ok["status"] == 200 and ok["key"] == KEY[-4:]
    assert ok["completion_tokens"] == 3 and ok["ending"] == "eof"
    assert ok["slot_id"] in (0, 1, 2, 3) and ok["ttft_ms"] > 0
    denied = next(e for e in lines if e["request_id"] == "logtest-2")
    assert denied["status"] == 401 and denied["key"] == "-"
    everything = opool.logs()
    assert KEY not in everything and SECRET_PROMPT not in everything


@pytest.fixture
def empty_pool(pool_factory):
    # Private: the tests add a worker, or stop the broker.
    with pool_factory(workers=0, wait_ready=False, private=True) as p:
        yield p


def get_health(pool) -> httpx.Response | None:
    try:
        return httpx.get(pool.url + "/health", timeout=5)
    except httpx.TransportError:
        return None  # gunicorn not listening yet


def test_health_goes_from_loading_to_ok(empty_pool):
    def health():
        return get_health(empty_pool)

    r = wait_until(health, 30, "gunicorn to answer")
    assert r.status_code == 503
    assert r.json() == {"error": {"code": 503, "message": "Loading model",
                                  "type": "unavailable_error"}}
    empty_pool.start_worker()
    wait_until(lambda: health().status_code == 200, 30, "/health to turn 200")
    assert health().json()["status"] == "ok"


def test_health_when_broker_is_down_answers_fast(empty_pool):
    wait_until(lambda: get_health(empty_pool), 30, "gunicorn to answer")
    empty_pool.broker.stop()
    # /health may answer from a ledger up to LLAMAPOOL_HEALTH_CACHE_S old, so
    # the first answer after the stop may still be the cached 200.
    r = wait_until(lambda: (r := httpx.get(empty_pool.url + "/health", timeout=5))
                   .status_code == 503 and r, 5, "/health to turn 503")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "broker unreachable"
    assert r.elapsed.total_seconds() < 3  # bounded by LLAMAPOOL_HEALTH_TIMEOUT_S


def test_broker_and_worker_serve_their_own_metrics(tiny_model, tmp_path):
    broker_port, worker_port = free_port(), free_port()
    fe, wk = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/wk"
    broker = Proc("broker", cli("broker", "--frontends", fe, "--workers", wk,
                                "--metrics-port", str(broker_port),
                                "--heartbeat-interval-s", "0.2"), tmp_path)
    worker = Proc("worker", cli("worker", "--broker", wk, "--model", str(tiny_model),
                                "--metrics-port", str(worker_port),
                                "--heartbeat-interval-s", "0.2"), tmp_path)
    try:
        def scrape_port(port, needle):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            except httpx.TransportError:
                return None
            return text if needle in text else None

        text = wait_until(
            lambda: scrape_port(broker_port,
                                'llamapool_slots_registered{model="tiny.gguf"} 1'),
            30, "the broker to export one registered slot")
        assert 'llama_tokens_generated_total{model="tiny.gguf"}' in text
        text = wait_until(lambda: scrape_port(worker_port, "llamapool_worker_loaded 1"),
                          30, "the worker to export loaded=1")
        assert "llamapool_worker_jobs_total 0.0" in text
        assert "llamapool_worker_unsent_dropped_total 0.0" in text
        assert "llamapool_worker_link_callback_errors_total 0.0" in text
    finally:
        worker.stop()
        broker.stop()


def test_shipped_prometheus_config_is_valid():
    promtool = require_tool("promtool")  # Debian package prometheus
    config = os.path.join(os.path.dirname(__file__), "..", "deploy", "prometheus",
                          "prometheus.yml")
    result = subprocess.run([promtool, "check", "config", "--syntax-only", config],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
