"""One pool, many models (issue 30), through real processes: each model's
``/metrics`` series count only its own jobs, and ``/tokenize``,
``/detokenize``, ``/apply-template`` and the prompt counts answer with the
vocabulary and template of the model the body names.

The pool: a broker, a worker of each of two distinct tiny GGUFs (``alpha``,
plain; ``bravo``, with a tools template and FIM tokens), and a frontend
given the models file (``--models``, as ``llamapool up --models`` gives it),
so it holds both vocabularies.
"""

from __future__ import annotations

import re

import httpx
import pytest

from llamapool.test_model import FIM_PIECES
from tests.pool import scrape_metrics, wait_until
from tests.test_many_models import MixedPool, make_model
from tests.test_slot_paths import LONG, RawStream, wait_paused

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
ALPHA, BRAVO = (("model", "alpha"),), (("model", "bravo"),)
TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def vocab_pool(tmp_path_factory):
    where = tmp_path_factory.mktemp("models")
    alpha = make_model(where / "alpha.gguf")
    bravo = make_model(where / "bravo.gguf", "--tools-template", "--fim")
    models = where / "models.toml"
    models.write_text(f'[alpha]\npath = "{alpha}"\naliases = ["a"]\n\n'
                      f'[bravo]\npath = "{bravo}"\naliases = ["b"]\nctx = 2048\n')
    pool = MixedPool(tmp_path_factory.mktemp("vocabs"), [
        ("alpha", alpha, ("--alias", "a"), 0),
        ("bravo", bravo, ("--alias", "b"), 0),
    ], frontend_args=("--models", str(models)))
    yield pool
    pool.stop()


def post(pool, path: str, body: dict) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=TIMEOUT_S)


def complete(pool, model: str, max_tokens: int, stream: bool = False):
    resp = post(pool, "/v1/completions", {
        "model": model, "prompt": "Hi", "max_tokens": max_tokens,
        "ignore_eos": True, "stream": stream})
    assert resp.status_code == 200, resp.text
    return resp


def grew(before: dict, after: dict, name: str, labels: tuple) -> float:
    return after.get((name, labels), 0) - before.get((name, labels), 0)


def test_each_models_series_count_only_its_own_jobs(vocab_pool):
    before = scrape_metrics(vocab_pool.url)
    # Not alternating, one of them streamed.
    for model in ("alpha", "alpha", "alpha"):
        complete(vocab_pool, model, 3)
    complete(vocab_pool, "b", 2, stream=True)  # by its alias
    assert post(vocab_pool, "/v1/completions", {
        "model": "no-such-model", "prompt": "Hi"}).status_code == 404
    after = scrape_metrics(vocab_pool.url)
    for name in ("llama_tokens_generated_total", "llamacpp:tokens_predicted_total"):
        assert grew(before, after, name, ALPHA) == 9, name
        assert grew(before, after, name, BRAVO) == 2, name
    assert grew(before, after, "llama_request_success_total", ALPHA) == 3
    assert grew(before, after, "llama_request_success_total", BRAVO) == 1
    assert grew(before, after, "llamacpp:n_decode_total", ALPHA) == 3 * (1 + 3)
    # The frontend's own series of a job, by the model it resolved to.
    for name in ("llamapool_time_to_first_token_seconds_count",
                 "llamapool_request_duration_seconds_count",
                 "llamapool_slot_hold_seconds_count"):
        assert grew(before, after, name, ALPHA) == 3, name
        assert grew(before, after, name, BRAVO) == 1, name
    assert grew(before, after, "llamapool_lease_endings_total",
                (("ending", "eof"), ("model", "alpha"))) == 3
    for labels in (ALPHA, BRAVO):
        assert after[("llamapool_slots_registered", labels)] == 1
        assert after[("llama_slots_processing", labels)] == 0
        assert after[("llamacpp:requests_processing", labels)] == 0
    # No series for a name a client made up, nor any llama series unlabelled.
    text = httpx.get(vocab_pool.url + "/metrics", timeout=TIMEOUT_S).text
    assert "no-such-model" not in text
    assert not re.search(r"^(llama_|llamacpp:)[^{\s]* ", text, re.M)


def test_a_full_models_refusals_are_its_own(vocab_pool):
    held = RawStream(vocab_pool.port, {**LONG, "model": "alpha"})
    try:
        slot_id = int(held.header("X-Slot-Id"))
        wait_paused(vocab_pool, slot_id)
        busy = scrape_metrics(vocab_pool.url)
        assert busy[("llama_slots_processing", ALPHA)] == 1
        assert busy[("llama_slots_processing", BRAVO)] == 0
        assert busy[("llamacpp:requests_processing", ALPHA)] == 1
        assert busy[("llama_kv_cache_usage_level", ALPHA)] > 0
        assert busy[("llama_kv_cache_usage_level", BRAVO)] == 0
        refused = post(vocab_pool, "/v1/completions", {"model": "alpha",
                                                       "prompt": "Hi"})
        assert refused.status_code == 503, refused.text
        after = scrape_metrics(vocab_pool.url)
    finally:
        held.close()
    wait_until(lambda: vocab_pool.loaded() == 2, 30, "alpha's slot to come back")
    assert grew(busy, after, "llamapool_broker_no_slot_total", ALPHA) == 1
    assert grew(busy, after, "llamapool_broker_no_slot_total", BRAVO) == 0
    assert grew(busy, after, "llamapool_requests_refused_no_slot_total", ALPHA) == 1
    assert grew(busy, after, "llamapool_lease_endings_total",
                (("ending", "refused"), ("model", "alpha"))) == 1


def test_tokenize_and_detokenize_use_the_named_models_vocabulary(vocab_pool):
    fim = FIM_PIECES[0]

    def tokens(model):
        resp = post(vocab_pool, "/tokenize", {"content": fim, "model": model,
                                              "with_pieces": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    # bravo has the FIM tokens: one token, by name or alias; alpha has not.
    assert [t["piece"] for t in tokens("bravo")] == [fim]
    assert tokens("b") == tokens("bravo")
    assert len(tokens("alpha")) > 1
    ids = [t["id"] for t in tokens("bravo")]
    back = post(vocab_pool, "/detokenize", {"tokens": ids, "model": "bravo"})
    assert back.status_code == 200 and back.json()["content"] == fim
    alpha_ids = [t["id"] for t in tokens("a")]
    back = post(vocab_pool, "/detokenize", {"tokens": alpha_ids, "model": "alpha"})
    # (alpha's pieces of it begin a word: a space before it.)
    assert back.status_code == 200 and back.json()["content"].strip() == fim


def test_apply_template_uses_the_named_models_template(vocab_pool):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS}
    bravo = post(vocab_pool, "/apply-template", {**body, "model": "bravo"})
    assert bravo.status_code == 200, bravo.text
    assert "weather" in bravo.json()["prompt"]  # its template renders tools
    alpha = post(vocab_pool, "/apply-template", {**body, "model": "alpha"})
    assert alpha.status_code == 400 and alpha.json()["error"]["param"] == "tools"
    plain = {"messages": body["messages"]}
    assert post(vocab_pool, "/apply-template",
                {**plain, "model": "a"}).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"content": "Hi"}),
    ("/detokenize", {"tokens": [1]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_vocabulary_endpoints_resolve_model_as_generation_does(vocab_pool, path,
                                                               body):
    unknown = post(vocab_pool, path, {**body, "model": "no-such-model"})
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["code"] == "model_not_found"
    missing = post(vocab_pool, path, body)
    generation = post(vocab_pool, "/v1/completions", {"prompt": "Hi"})
    assert missing.status_code == generation.status_code == 400, missing.text
    assert missing.json()["error"]["param"] == "model"


def test_prompt_counts_use_the_named_models_vocabulary(vocab_pool):
    # Counted at the door for both models (the frontend holds both
    # vocabularies), equal to what a real request of each reports.
    for model, tools in (("alpha", None), ("bravo", TOOLS)):
        body = {"model": model,
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                **({"tools": tools} if tools else {})}
        submitted = vocab_pool.status()["counters"].get("submitted", 0)
        counted = post(vocab_pool, "/v1/chat/completions/input_tokens", body)
        assert counted.status_code == 200, counted.text
        # No job: the door counted it (a worker's count is a SUBMIT).
        assert vocab_pool.status()["counters"].get("submitted", 0) == submitted
        served = post(vocab_pool, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert served.status_code == 200, served.text
        n = served.json()["usage"]["prompt_tokens"]
        assert counted.json()["input_tokens"] == n, model
    submitted = vocab_pool.status()["counters"].get("submitted", 0)
    anthropic = post(vocab_pool, "/v1/messages/count_tokens", {
        "model": "b", "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}]})
    assert anthropic.status_code == 200, anthropic.text
    plain = post(vocab_pool, "/v1/messages/count_tokens", {
        "model": "b", "messages": [{"role": "user", "content": "Hi"}]})
    assert anthropic.json()["input_tokens"] > plain.json()["input_tokens"]
    assert vocab_pool.status()["counters"].get("submitted", 0) == submitted
