"""Server-side request defaults (issue 34, item 11): ``llamapool worker
--n-predict/--seed/--temp/--top-k/...``, as llama-server users put ``-n``,
``--seed`` and ``--temp`` in their unit files.

A request that leaves a field out gets the worker's default; an explicit
value always wins; ``/props`` shows the defaults in force. Through real
gunicorn, a real broker and a real worker on the tiny GGUF; the parsing of
what was left out, and the models file, in process.
"""

from __future__ import annotations

import httpx
import pytest

from frontend import anthropic_schema, native_schema, openai_schema
from llamapool.models_file import load_models_file
from protocol.payloads import GenerationRequest, RequestDefaults, Sampling
from protocol.settings import ConfigError, load
from tests.pool_factory import pool_fixture
from workers.model.settings import WorkerSettings

TIMEOUT_S = 120
N_PREDICT = 5
SEED = 42

defaults_pool = pool_fixture(workers=1, worker_args=(
    "--n-predict", str(N_PREDICT), "--temp", "0", "--seed", str(SEED),
    "--top-k", "7"))


# --- in process: what the frontend marks, what a worker fills ---------------------


def test_the_parsers_mark_what_the_client_left_out():
    chat = openai_schema.parse_chat({"messages": [{"role": "user", "content": "x"}],
                                     "temperature": 0.5, "seed": None}).generation
    assert "temperature" not in chat.defaulted
    assert {"max_tokens", "seed", "top_k", "top_p"} <= set(chat.defaulted)
    native = native_schema.parse_completion({"prompt": "x", "n_predict": 3})
    assert "max_tokens" not in native.generation.defaulted
    # llama-server: a request's n_predict -1 leaves its -n in force.
    unlimited = native_schema.parse_completion({"prompt": "x", "n_predict": -1})
    assert "max_tokens" in unlimited.generation.defaulted
    completion = openai_schema.parse_completion({"prompt": "x"}).generation
    assert completion.max_tokens == openai_schema.COMPLETION_MAX_TOKENS
    assert "max_tokens" in completion.defaulted
    messages = anthropic_schema.parse_messages({
        "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]})
    assert "max_tokens" not in messages.generation.defaulted


def test_a_worker_fills_only_what_was_left_out():
    defaults = RequestDefaults(n_predict=5, temperature=0.0, seed=1)
    request = GenerationRequest(kind="completion", prompt="x", max_tokens=16,
                                sampling=Sampling(temperature=1.5),
                                defaulted=["max_tokens", "seed"])
    filled = defaults.fill(request)
    assert filled.max_tokens == 5 and filled.sampling.seed == 1
    assert filled.sampling.temperature == 1.5  # the client's own value
    assert RequestDefaults().fill(request) is request  # no defaults: as sent
    assert RequestDefaults(n_predict=-1).fill(request).max_tokens is None


def test_bad_defaults_are_refused_at_start():
    for env in ({"LLAMAPOOL_TOP_P": "1.5"}, {"LLAMAPOOL_N_PREDICT": "-2"},
                {"LLAMAPOOL_REPEAT_PENALTY": "0"}, {"LLAMAPOOL_SEED": "-1"}):
        with pytest.raises(ConfigError):
            load(WorkerSettings, {"LLAMAPOOL_BROKER": "ipc://x", **env})


def test_the_models_file_takes_defaults_per_model(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    models = tmp_path / "models.toml"
    models.write_text(f'[chat]\npath = "{model}"\ntemp = 0\nn_predict = 64\n'
                      f'seed = 7\ntop_p = 0.5\n')
    spec, = load_models_file(str(models), 1)
    assert {k: spec.worker_flags[k] for k in ("temperature", "n_predict", "seed",
                                               "top_p")} == {
        "temperature": 0, "n_predict": 64, "seed": 7, "top_p": 0.5}
    models.write_text(f'[chat]\npath = "{model}"\ntop_p = 2\n')
    with pytest.raises(ConfigError, match="chat"):
        load_models_file(str(models), 1)


# --- through a real pool ---------------------------------------------------------


def completion(pool, **body) -> dict:
    resp = httpx.post(pool.url + "/completion",
                      json={"prompt": "Once upon a time", "ignore_eos": True, **body},
                      timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.stack
def test_a_request_without_a_budget_gets_the_workers_n_predict(defaults_pool):
    assert completion(defaults_pool)["tokens_predicted"] == N_PREDICT
    # llama-server: -1 is "no limit of my own", so -n applies.
    assert completion(defaults_pool, n_predict=-1)["tokens_predicted"] == N_PREDICT
    # The request's own value wins, below the default and above it.
    assert completion(defaults_pool, n_predict=2)["tokens_predicted"] == 2
    assert completion(defaults_pool, n_predict=9)["tokens_predicted"] == 9
    chat = httpx.post(defaults_pool.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True},
        timeout=TIMEOUT_S).json()
    assert chat["usage"]["completion_tokens"] == N_PREDICT
    # Not OpenAI's 16: the worker's default replaces the endpoint's.
    legacy = httpx.post(defaults_pool.url + "/v1/completions", json={
        "prompt": "Hi", "ignore_eos": True}, timeout=TIMEOUT_S).json()
    assert legacy["usage"]["completion_tokens"] == N_PREDICT


@pytest.mark.stack
def test_the_workers_temperature_and_seed_apply_and_a_request_overrides_them(
        defaults_pool):
    def text(**body) -> str:
        return completion(defaults_pool, n_predict=16, **body)["content"]

    greedy = text()
    assert text() == greedy == text(temperature=0)  # --temp 0: greedy
    # A hot request with no seed of its own: the worker's --seed, every time.
    hot = text(temperature=1.5, top_k=0)
    assert text(temperature=1.5, top_k=0) == hot == text(temperature=1.5, top_k=0,
                                                        seed=SEED)
    # Its own seed wins: some other seed samples something else.
    others = {text(temperature=1.5, top_k=0, seed=s) for s in range(1, 6)}
    assert others - {hot}


@pytest.mark.stack
def test_props_shows_the_defaults_in_force(defaults_pool):
    props = httpx.get(defaults_pool.url + "/props", timeout=TIMEOUT_S).json()
    params = props["default_generation_settings"]["params"]
    assert params["n_predict"] == params["max_tokens"] == N_PREDICT
    assert params["temperature"] == 0.0 and params["seed"] == SEED
    assert params["top_k"] == 7
    assert params["top_p"] == Sampling().top_p  # not set: the pool's default


def test_up_hands_the_defaults_to_its_workers():
    from llamapool import cli
    from llamapool.supervisor import UP_WORKER_FLAGS
    from protocol.settings import as_argv, given_flags

    args = cli.build_parser().parse_args(
        ["up", "--temp", "0", "--n-predict", "5", "--seed", "3"])
    argv = as_argv(WorkerSettings, given_flags(args, WorkerSettings, UP_WORKER_FLAGS))
    assert argv == ["--n-predict", "5", "--seed", "3", "--temp", "0.0"]


@pytest.mark.stack
def test_a_completion_answer_shows_the_settings_it_ran_with(defaults_pool):
    settings = completion(defaults_pool)["generation_settings"]
    assert settings["n_predict"] == N_PREDICT and settings["seed"] == SEED
    assert settings["temperature"] == 0.0 and settings["top_k"] == 7
    own = completion(defaults_pool, n_predict=3, temperature=0.5,
                     seed=9)["generation_settings"]
    assert (own["n_predict"], own["temperature"], own["seed"]) == (3, 0.5, 9)


#: A worker of two slots decoded as one batch: the same defaults, filled
#: where the job is handed over, before either engine sees it.
batched_pool = pool_fixture(workers=1, slots_per_worker=2, worker_args=(
    "--n-predict", str(N_PREDICT), "--seed", str(SEED)))


@pytest.mark.stack
def test_a_batched_worker_applies_its_defaults_too(batched_pool):
    answer = completion(batched_pool)
    assert answer["tokens_predicted"] == N_PREDICT
    assert answer["generation_settings"]["seed"] == SEED
    assert completion(batched_pool, n_predict=2)["tokens_predicted"] == 2
    props = httpx.get(batched_pool.url + "/props", timeout=TIMEOUT_S).json()
    assert props["default_generation_settings"]["params"]["n_predict"] == N_PREDICT
