"""``llamapool bench``, the synthetic engine and the locust file, for real.

Every load run is the real CLI (``python -m llamapool bench ... --json``)
against real servers: our pool on the tiny model, our pool on the synthetic
engine, and llama-cpp-python's own server as a separate process.
"""

from __future__ import annotations

import csv
import json
import os
import select
import signal
import socket
import subprocess
import sys
import urllib.request

import httpx
import pytest

from llamapool import loadgen
from protocol.payloads import ChatMessage, GenerationRequest
from tests.pool import Proc, cli, free_port, wait_until
from tests.pool_factory import pool_fixture
from workers.model.engine import RequestRejected
from workers.model.synthetic_engine import SyntheticEngine

pytestmark = pytest.mark.stack

SYNTHETIC_TPS = 100
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCUSTFILE = os.path.join(REPO, "deploy", "locust", "locustfile.py")


def bench(url: str, *args: str, timeout_s: float = 120) -> dict:
    """Run ``llamapool bench --json`` and return its report."""
    done = subprocess.run(
        cli("bench", url, "--json", "--no-progress", *args),
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_ordered(percentiles: dict) -> None:
    values = list(percentiles.values())
    assert all(v is not None and v > 0 for v in values), percentiles
    assert values == sorted(values), percentiles


#: Broker + 2 synthetic workers (100 tokens/s) + gunicorn.
synthetic_pool = pool_fixture(workers=2, worker_args=(
    "--engine", "synthetic", "--tokens-per-second", str(SYNTHETIC_TPS)))


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory):
    """llama-cpp-python's own OpenAI server on the tiny model, in F32: what is
    under test is the load generator, and that server has no switch for
    llama.cpp's weight repacking, whose AMX kernel crashes on Q4 weights
    (``workers.model.weight_repack``); F32 weights are never repacked."""
    run_dir = tmp_path_factory.mktemp("llama-cpp-server")
    model = run_dir / "tiny-f32.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    str(model), "--quant", "f32"], check=True,
                   capture_output=True)
    port = free_port()
    proc = Proc("llama-cpp-server", [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
    ], run_dir)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.alive(), proc.log()
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    wait_until(up, 60, "llama-cpp-python's server to answer")
    yield url
    proc.stop()


# --- against our pool on the tiny model -------------------------------------


def test_bench_completions_against_pool(pool):
    report = bench(pool.url, "--requests", "8", "--concurrency", "2",
                   "--max-tokens", "16", "--ignore-eos")
    assert report["url"] == pool.url + "/v1/completions"
    assert report["requests_sent"] == 8
    assert report["requests_completed"] == 8
    assert report["requests_rejected_503"] == 0
    assert report["requests_failed"] == 0 and report["errors"] == {}
    assert report["status_counts"] == {"200": 8}
    # ignore_eos was sent: every request ran to max_tokens, per the usage chunk.
    assert report["token_count_source"] == "usage"
    assert report["output_tokens"] == 8 * 16
    assert report["requests_per_s"] > 0 and report["output_tokens_per_s"] > 0
    assert_ordered(report["ttft_ms"])
    assert_ordered(report["latency_ms"])
    assert report["itl_ms"]["p50"] is not None
    assert report["latency_ms"]["p50"] >= report["ttft_ms"]["p50"]
    pool.assert_whole()


def test_bench_chat_with_v1_in_url(pool):
    report = bench(pool.url + "/v1/", "--chat", "--requests", "3",
                   "--max-tokens", "8", "--ignore-eos", "--prompt", "Hello there")
    assert report["url"] == pool.url + "/v1/chat/completions"
    assert report["requests_completed"] == 3
    assert report["output_tokens"] == 3 * 8


def test_bench_counts_503s_apart_when_concurrency_exceeds_slots(pool):
    # Six clients at once against two slots; 2000 tokens keep a slot busy far
    # longer than it takes the other four to be refused.
    report = bench(pool.url, "--requests", "12", "--concurrency", "6",
                   "--max-tokens", "2000", "--ignore-eos")
    assert report["requests_sent"] == 12
    assert report["requests_rejected_503"] >= 4
    assert report["status_counts"]["503"] == report["requests_rejected_503"]
    assert report["requests_failed"] == 0 and report["errors"] == {}
    assert (report["requests_completed"] + report["requests_rejected_503"]) == 12
    assert report["rejections_per_s"] > 0
    assert report["rejected_latency_ms"]["p50"] is not None
    pool.assert_whole()


def test_bench_prompt_file(pool, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time")
    report = bench(pool.url, "--prompt-file", str(prompt), "--requests", "2",
                   "--max-tokens", "4", "--ignore-eos")
    assert report["requests_completed"] == 2


@pytest.mark.parametrize("args", [
    ["--requests", "3", "--duration", "2"],
    ["--concurrency", "0"],
    ["--max-tokens", "-1"],
    ["--wait-after-503", "-0.5"],
    ["--prompt", "a", "--prompt-file", "b"],
    ["--prompt-file", "/nonexistent/prompt.txt"],
])
def test_bench_usage_errors_exit_nonzero(args):
    done = subprocess.run(cli("bench", "http://127.0.0.1:9", *args),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)


def closed_by_peer(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def test_a_connection_the_server_closed_while_idle_is_replaced(pool):
    """gunicorn closes a kept-alive connection after 5 idle seconds; the
    client's next request must not fail on it (BrokenPipeError before)."""
    client = loadgen.Client(loadgen.BenchConfig(
        base_url=pool.url, max_tokens=2, prompt="Hi", ignore_eos=True))
    try:
        assert client.one_request().ok
        idle = client._conn.sock
        wait_until(lambda: closed_by_peer(idle), 60,
                   "the server to close the idle connection", interval_s=0.1)
        result = client.one_request()
        assert result.ok, result.error
        assert result.output_tokens == 2
    finally:
        client.close()


def test_bench_exits_zero_when_requests_fail():
    port = free_port()  # nothing listens here
    report = bench(f"http://127.0.0.1:{port}", "--requests", "2")
    assert report["requests_failed"] == 2
    assert report["errors"] == {"ConnectionRefusedError": 2}
    assert report["status_counts"] == {"none": 2}
    assert report["ttft_ms"]["p50"] is None


# --- against llama-cpp-python's server ---------------------------------------


def test_bench_against_llama_cpp_python_server(llama_cpp_server):
    report = bench(llama_cpp_server + "/v1", "--requests", "4",
                   "--max-tokens", "8", "--prompt", "Hello")
    assert report["requests_completed"] == 4, report
    assert report["requests_failed"] == 0
    # It sends no usage chunk when streaming: tokens are counted from chunks.
    assert report["token_count_source"] == "chunks"
    assert 0 < report["output_tokens"] <= 4 * 8
    assert report["ttft_ms"]["p50"] is not None


def test_bench_chat_against_llama_cpp_python_server(llama_cpp_server):
    report = bench(llama_cpp_server, "--chat", "--requests", "2",
                   "--max-tokens", "8")
    assert report["requests_completed"] == 2, report
    assert report["status_counts"] == {"200": 2}


# --- the synthetic engine ------------------------------------------------------


def test_synthetic_pool_says_synthetic(synthetic_pool):
    models = httpx.get(synthetic_pool.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["synthetic"]
    assert models["data"][0]["meta"]["engine"] == "synthetic"
    assert models["data"][0]["meta"]["slots"] == 2
    slots = httpx.get(synthetic_pool.url + "/slots", timeout=10).json()
    assert len(slots) == 2
    assert {s["engine"] for s in slots} == {"synthetic"}
    assert {s["model"] for s in slots} == {"synthetic"}


def test_synthetic_text_is_deterministic_and_stops(synthetic_pool):
    url = synthetic_pool.url + "/v1/completions"
    whole = httpx.post(url, json={"prompt": "one two three", "max_tokens": 5},
                       timeout=30).json()
    assert whole["choices"][0]["text"] == "tok0 tok1 tok2 tok3 tok4"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 5
    # A stop string split over two tokens never leaks.
    stopped = httpx.post(url, json={"prompt": "x", "max_tokens": 50,
                                    "stop": ["2 tok3"]}, timeout=30).json()
    assert stopped["choices"][0]["text"] == "tok0 tok1 tok"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    synthetic_pool.assert_whole()


def test_bench_against_synthetic_pool(synthetic_pool):
    report = bench(synthetic_pool.url, "--requests", "4", "--concurrency", "2",
                   "--max-tokens", "10")
    assert report["requests_completed"] == 4
    # The synthetic engine has no EOS: max_tokens always.
    assert report["output_tokens"] == 40
    # Ten tokens at 100/s cannot take less than 0.1 s, however loaded the
    # machine. (The gaps between tokens can: a delayed frontend sends a
    # burst of queued frames.)
    assert report["latency_ms"]["p50"] >= 1000 * 10 / SYNTHETIC_TPS * 0.9
    assert 0 <= report["itl_ms"]["p50"] <= report["latency_ms"]["p50"]


def test_bench_duration_mode(synthetic_pool):
    report = bench(synthetic_pool.url, "--duration", "1", "--concurrency", "2",
                   "--max-tokens", "5", "--wait-after-503", "0.01")
    assert report["duration_s"] >= 1.0
    assert report["requests_sent"] >= 4
    assert report["requests_completed"] == report["requests_sent"]


def test_bench_reports_mid_stream_error_event(synthetic_pool):
    """A worker killed mid-stream: HTTP 200, then an error event; counted."""
    pool = synthetic_pool
    runner = subprocess.Popen(
        cli("bench", pool.url, "--json", "--no-progress", "--requests", "1",
            "--max-tokens", "2000"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        def busy_slot():
            for slot in pool.status()["slots"]:
                if slot["state"] != "idle" and slot["progress"].get("n_generated"):
                    return slot
            return None

        slot = wait_until(busy_slot, 30, "a slot to be generating", interval_s=0.05)
        victim = next(w for w in pool.workers if w.pid == slot["pid"])
        os.kill(slot["pid"], signal.SIGKILL)
        victim.popen.wait(timeout=10)
        out, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["status_counts"] == {"200": 1}
    assert report["requests_failed"] == 1
    assert report["errors"] == {"stream error: worker_died": 1}
    pool.workers.remove(victim)
    pool.start_worker()
    pool.wait_free(2, timeout_s=30)


def test_synthetic_worker_needs_no_model(synthetic_pool, tmp_path):
    extra = Proc("worker-no-model", cli(
        "worker", "--broker", synthetic_pool.workers_ep, "--engine", "synthetic",
        "--heartbeat-interval-s", "0.2", "--heartbeat-liveness", "3",
    ), tmp_path)
    try:
        synthetic_pool.wait_free(3, timeout_s=30)
    finally:
        assert extra.stop() == 0
    synthetic_pool.wait_free(2, timeout_s=15)


def test_llama_cpp_worker_without_model_is_a_usage_error(tmp_path):
    done = subprocess.run(
        cli("worker", "--broker", f"ipc://{tmp_path}/nobody"),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "--model" in done.stderr


# --- the synthetic engine in process: the JobSink contract -------------------


class RecordingSink:
    """A JobSink that records calls; it can refuse credit or ask to stop."""

    def __init__(self, stop_after: int | None = None, credit: bool = True):
        self.stop_after = stop_after
        self.credit = credit
        self.emitted: list[tuple[str, int]] = []
        self.progress: list[tuple] = []
        self.credit_waits = 0

    def emit(self, text: str, n_tokens: int) -> None:
        assert self.credit_waits > len(self.emitted), "emit without credit"
        self.emitted.append((text, n_tokens))

    def should_stop(self) -> bool:
        return self.stop_after is not None and len(self.emitted) >= self.stop_after

    def wait_for_credit(self) -> bool:
        self.credit_waits += 1
        return self.credit

    def report_progress(self, *args) -> None:
        self.progress.append(args)

    def threads_to_use(self, current: int) -> int:
        return current


FAST = SyntheticEngine(tokens_per_second=100_000, n_ctx=64)


def test_synthetic_engine_max_tokens_and_progress():
    sink = RecordingSink()
    result = FAST.run(GenerationRequest("completion", "a b c", max_tokens=3), sink)
    assert sink.emitted == [("tok0", 1), (" tok1", 1), (" tok2", 1)]
    assert (result.finish_reason, result.prompt_tokens,
            result.completion_tokens) == ("length", 3, 3)
    assert sink.progress[-1][:3] == (3, 3, 3)


def test_synthetic_engine_holds_back_a_possible_stop_prefix():
    sink = RecordingSink()
    result = FAST.run(GenerationRequest("completion", "a", max_tokens=3,
                                        stop=["tok2x"]), sink)
    assert "".join(t for t, _ in sink.emitted) == "tok0 tok1 "
    # The held-back "tok2" never turned into the stop string: released at the end.
    assert (result.tail_text, result.finish_reason) == ("tok2", "length")


def test_synthetic_engine_cancel_and_stall():
    cancelled = RecordingSink(stop_after=2)
    result = FAST.run(GenerationRequest("completion", "a", max_tokens=50),
                      cancelled)
    assert result.finish_reason == "cancelled" and len(cancelled.emitted) == 2
    stalled = RecordingSink(credit=False)
    result = FAST.run(GenerationRequest("completion", "a", max_tokens=50),
                      stalled)
    assert result.finish_reason == "cancelled" and stalled.emitted == []


def test_synthetic_engine_chat_prompt_and_context():
    sink = RecordingSink()
    chat = GenerationRequest("chat", max_tokens=None,
                             messages=[ChatMessage("user", "one two"),
                                       ChatMessage("user", "three")])
    result = FAST.run(chat, sink)
    # No max_tokens: the rest of the context.
    assert (result.prompt_tokens, result.completion_tokens) == (3, 61)
    with pytest.raises(RequestRejected):
        FAST.run(GenerationRequest("completion", "w " * 64, max_tokens=1),
                 RecordingSink())
    tokenised = FAST.run(GenerationRequest("completion", "ignored",
                                           prompt_tokens=[1, 2, 3, 4],
                                           max_tokens=0), sink)
    assert (tokenised.prompt_tokens, tokenised.completion_tokens) == (4, 0)


# --- locust ---------------------------------------------------------------------


def test_locustfile_headless(synthetic_pool, tmp_path):
    prefix = tmp_path / "locust"
    env = dict(os.environ, LLAMAPOOL_LOCUST_MAX_TOKENS="8",
               LLAMAPOOL_API_KEY="unused-by-an-open-pool")
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless",
         "-u", "2", "-r", "2", "-t", "10s", "--stop-timeout", "5",
         "--host", synthetic_pool.url, "--csv", str(prefix), "--only-summary"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 10, rows
    assert int(total["Failure Count"]) == 0, rows
    for name in ("/chat/completions (stream)", "/completions (stream)",
                 "TTFT chat", "TTFT completions"):
        assert int(rows[name]["Request Count"]) > 0, (name, rows)
    # TTFT is a part of the whole stream's time.
    assert float(rows["TTFT chat"]["Median Response Time"]) <= float(
        rows["/chat/completions (stream)"]["Median Response Time"])
    synthetic_pool.assert_whole()
