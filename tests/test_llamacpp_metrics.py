"""llama.cpp's ``llamacpp:*`` series and ``Process-Start-Time-Unix`` header.

A dashboard made for llama-server reads these exact names (issue 11,
section 3). The names, types and help texts below are llama-server's
(``server_task_result_metrics::to_metrics`` in the vendored
``tools/server/server-task.cpp``); the values must be the pool's real counts,
the same ones our ``llama_*`` series show.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.stack

#: The pool's one model (its workers' file's name): every series about a
#: model's work carries it as its ``model`` label (issue 30).
MODEL = "tiny.gguf"


def of_model(name: str) -> str:
    """A series of the pool's one model, as its sample line names it."""
    return f'{name}{{model="{MODEL}"}}'

#: name -> (type, help), as llama-server writes them.
LLAMACPP_SERIES = {
    "prompt_tokens_total": (
        "counter", "Number of prompt tokens processed, excluding cached tokens"),
    "prompt_tokens_cached_total": (
        "counter", "Number of prompt tokens reused from the cache"),
    "prompt_seconds_total": ("counter", "Total time spent processing prompts"),
    "tokens_predicted_total": ("counter", "Number of generation tokens processed"),
    "tokens_predicted_seconds_total": (
        "counter", "Total time spent generating tokens"),
    "n_decode_total": (
        "counter", "Total number of llama_decode() calls, excluding speculative "
        "decoding and multimodal decoding"),
    "n_tokens_max": (
        "counter", "Largest observed sequence length (prompt + generation)"),
    "spec_decode_num_draft_tokens_total": (
        "counter", "Speculative: Total draft tokens generated"),
    "spec_decode_num_accepted_tokens_total": (
        "counter", "Speculative: Total draft tokens accepted by the target model"),
    "spec_decode_num_drafts_total": (
        "counter", "Speculative: Total speculative decoding verification steps"),
    "prompt_tokens_seconds": ("gauge", "Average prompt throughput in tokens/s"),
    "predicted_tokens_seconds": (
        "gauge", "Average generation throughput in tokens/s"),
    "requests_processing": ("gauge", "Number of requests processing"),
    "requests_deferred": ("gauge", "Number of requests deferred"),
    "n_busy_slots_per_decode": (
        "gauge", "Average number of busy slots per llama_decode() call"),
}


def scrape(pool) -> tuple[httpx.Response, dict[str, float]]:
    r = httpx.get(pool.url + "/metrics", timeout=30)
    assert r.status_code == 200
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return r, values


def test_llama_cpp_series_have_its_names_types_and_help(whole_pool):
    r, _ = scrape(whole_pool)
    lines = r.text.splitlines()
    for name, (kind, help_text) in LLAMACPP_SERIES.items():
        at = lines.index(f"# HELP llamacpp:{name} {help_text}")
        assert lines[at + 1] == f"# TYPE llamacpp:{name} {kind}"
        # One sample per model; this pool's one model.
        assert lines[at + 2].startswith(of_model(f"llamacpp:{name}") + " ")
        assert not lines[at + 3:at + 4] or not lines[at + 3].startswith(
            f"llamacpp:{name}")
    # The whole exposition still parses (colons are legal in names).
    families = {f.name for f in text_string_to_metric_families(r.text)}
    assert "llamacpp:requests_processing" in families


def test_llama_cpp_values_are_the_pools_counts(whole_pool):
    _, before = scrape(whole_pool)
    usages = []
    prompt = "The same long prefix for the KV cache to keep. " * 8
    for _ in range(3):  # a repeated prompt: later ones reuse the cache
        r = httpx.post(whole_pool.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        usages.append(r.json())
    _, after = scrape(whole_pool)

    def grew(name):
        return after[of_model(name)] - before[of_model(name)]

    assert grew("llamacpp:tokens_predicted_total") == 15
    assert grew("llamacpp:tokens_predicted_total") == grew(
        "llama_tokens_generated_total")
    computed = sum(u["timings"]["prompt_n"] for u in usages)
    cached = sum(u["usage"]["prompt_tokens_details"]["cached_tokens"]
                 for u in usages)
    assert cached > 0  # the pool routes the repeats to the warm worker
    assert grew("llamacpp:prompt_tokens_total") == computed
    assert grew("llamacpp:prompt_tokens_cached_total") == cached
    assert grew("llamacpp:prompt_seconds_total") == pytest.approx(
        grew("llama_prompt_seconds_total"))
    assert grew("llamacpp:tokens_predicted_seconds_total") == pytest.approx(
        grew("llama_tokens_seconds_total"))
    assert after[of_model("llamacpp:n_tokens_max")] >= max(
        u["usage"]["total_tokens"] for u in usages)
    assert grew("llamacpp:n_decode_total") == 15 + sum(
        1 for u in usages if u["timings"]["prompt_n"] > 0)
    assert after[of_model("llamacpp:predicted_tokens_seconds")] == pytest.approx(
        after[of_model("llamacpp:tokens_predicted_total")]
        / after[of_model("llamacpp:tokens_predicted_seconds_total")])
    assert after[of_model("llamacpp:n_busy_slots_per_decode")] == 1.0
    assert after[of_model("llamacpp:requests_processing")] == 0  # nothing running now
    assert after[of_model("llamacpp:requests_deferred")] == 0


def test_metrics_answer_carries_process_start_time(whole_pool):
    r, _ = scrape(whole_pool)
    started = int(r.headers["Process-Start-Time-Unix"])
    assert time.time() - 3600 < started <= time.time()
    again, _ = scrape(whole_pool)
    assert int(again.headers["Process-Start-Time-Unix"]) == started
