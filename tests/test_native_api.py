"""llama.cpp's native endpoints through a real pool (issue 11, section 2).

``/completion``, ``/infill``, ``/tokenize``, ``/detokenize``,
``/apply-template`` and ``/props``, and the native fields ``id_slot``,
``cache_prompt``, ``return_tokens`` and ``n_probs``. The tiny model has random
weights, so text is checked by shape, counts and consistency: a tokenize /
detokenize round trip, a streamed answer that concatenates to the whole one
under greedy sampling, ``tokens`` that detokenise to ``content``, and a
grammar where a test needs to know the output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from llamapool.test_model import BOS_ID, CHAT_TEMPLATE, FIM_PIECES
from tests.pool import Pool, sse_events
from tests.pool_factory import pool_fixture
from tests.test_slot_paths import RawStream, wait_paused

pytestmark = pytest.mark.stack

TIMEOUT_S = 60
TEXT = "Hello world, how are you? I am a test model."


def _post(pool: Pool, path: str, body: dict) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, timeout=TIMEOUT_S)


def _submitted(pool: Pool) -> int:
    return pool.status()["counters"].get("submitted", 0)


def _tokens(pool: Pool, text: str, **flags) -> list[int]:
    r = _post(pool, "/tokenize", {"content": text, **flags})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# --- /tokenize and /detokenize ----------------------------------------------------


def test_tokenize_detokenize_round_trip_without_a_slot(whole_pool):
    before = _submitted(whole_pool)
    tokens = _tokens(whole_pool, TEXT)
    assert tokens and BOS_ID not in tokens  # llama.cpp: add_special false
    assert _tokens(whole_pool, TEXT, add_special=True) == [BOS_ID, *tokens]
    r = _post(whole_pool, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json()["content"].strip() == TEXT
    pieces = _tokens(whole_pool, TEXT, with_pieces=True)
    assert [p["id"] for p in pieces] == tokens
    assert "".join(p["piece"] for p in pieces) == r.json()["content"]
    assert _submitted(whole_pool) == before  # no job, no slot


def test_tokenize_special_tokens_and_partial_characters(whole_pool):
    # parse_special (default true) reads "<|im_start|>" as one control token.
    assert len(_tokens(whole_pool, "<|im_start|>")) == 1
    assert len(_tokens(whole_pool, "<|im_start|>", parse_special=False)) > 1
    # The tiny vocabulary has no "é": two byte tokens, each half a character,
    # shown as byte lists like llama.cpp; the ids detokenise back to "é".
    pieces = _tokens(whole_pool, "é", with_pieces=True)
    byte_pieces = [p["piece"] for p in pieces if isinstance(p["piece"], list)]
    assert byte_pieces == [[0xC3], [0xA9]]
    r = _post(whole_pool, "/detokenize", {"tokens": [p["id"] for p in pieces]})
    assert r.json()["content"].strip() == "é"
    # A mixed content: ids kept in place, texts tokenised.
    mixed = _tokens(whole_pool, [BOS_ID, "Hello"])
    assert mixed == [BOS_ID, *_tokens(whole_pool, "Hello")]


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [1], "special": True}, "special"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "foo": 1}, "foo"),
])
def test_tokenizer_bad_input_is_a_400_naming_the_field(whole_pool, path, body, param):
    assert _error(_post(whole_pool, path, body), 400)["param"] == param


# --- /apply-template --------------------------------------------------------------


def test_apply_template_is_what_the_chat_endpoint_generates_from(whole_pool):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    r = _post(whole_pool, "/apply-template", {"messages": messages})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert prompt == ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    chat = _post(whole_pool, "/v1/chat/completions",
                 {"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    # The template writes the BOS itself: tokenised as the chat endpoint does.
    assert len(_tokens(whole_pool, prompt)) == chat.json()["usage"]["prompt_tokens"]
    bad = _post(whole_pool, "/apply-template", {"messages": [{"role": "x"}]})
    assert _error(bad, 400)["param"] == "messages[0].role"


# --- /props -----------------------------------------------------------------------


def test_props_describes_the_pool(whole_pool):
    r = httpx.get(whole_pool.url + "/props", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    props = r.json()
    assert props["total_slots"] == 2  # pool-wide: both workers
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 2048
    assert settings["params"]["temperature"] == 0.8
    assert settings["params"]["top_k"] == 40
    assert props["chat_template"] == CHAT_TEMPLATE
    assert (props["bos_token"], props["eos_token"]) == ("<s>", "</s>")
    # The file's name, never its directory (issue 29).
    assert props["model_path"] == whole_pool.model_path.name
    assert "llama-cpp-python" in props["build_info"]
    assert props["modalities"] == {"vision": False, "audio": False, "video": False}
    error = _error(_post(whole_pool, "/props", {"n_ctx": 1}), 501)
    assert error["type"] == "not_supported_error"
    assert "does not support changing global properties" in error["message"]


# --- /completion ------------------------------------------------------------------

GREEDY = {"temperature": 0, "seed": 3, "ignore_eos": True}


def test_completion_native_shape_with_token_prompt(whole_pool):
    ids = _tokens(whole_pool, TEXT, add_special=True)
    r = _post(whole_pool, "/completion",
              {"prompt": ids, "n_predict": 6, "return_tokens": True, **GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["index"] == 0
    assert out["tokens_evaluated"] == len(ids)
    assert out["tokens_predicted"] == 6 == len(out["tokens"])
    assert out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert out["truncated"] is False
    assert out["id_slot"] == int(r.headers["X-Slot-Id"])
    assert out["generation_settings"]["n_predict"] == 6
    assert out["generation_settings"]["temperature"] == 0
    timings = out["timings"]
    assert timings["predicted_n"] == 6
    assert timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert out["prompt"] == "<s> " + TEXT  # specials shown, as llama.cpp
    detok = _post(whole_pool, "/detokenize", {"tokens": out["tokens"]}).json()
    assert detok["content"] == out["content"]


def test_text_and_mixed_prompts_count_as_tokenize_says(whole_pool):
    r = _post(whole_pool, "/completion", {"prompt": TEXT, "n_predict": 1})
    assert r.json()["tokens_evaluated"] == len(_tokens(whole_pool, TEXT,
                                                       add_special=True))
    mixed = [BOS_ID, 400, "Hello", 401]
    r = _post(whole_pool, "/completion", {"prompt": mixed, "n_predict": 1})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] == 3 + len(_tokens(whole_pool, "Hello"))


def test_streamed_chunks_concatenate_to_the_whole_answer(whole_pool):
    body = {"prompt": TEXT, "n_predict": 12, "return_tokens": True, **GREEDY}
    whole = _post(whole_pool, "/completion", body).json()
    with httpx.stream("POST", whole_pool.url + "/completion",
                      json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    *chunks, last = events
    assert chunks and all(c["stop"] is False for c in chunks)
    assert {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted",
            "tokens_evaluated"} <= set(chunks[0])
    assert [c["tokens_predicted"] for c in chunks] == sorted(
        c["tokens_predicted"] for c in chunks)
    assert last["stop"] is True and "timings" in last
    assert "".join(c["content"] for c in events) == whole["content"]
    assert [t for c in events for t in c["tokens"]] == whole["tokens"]
    assert last["tokens_predicted"] == whole["tokens_predicted"] == 12


def test_n_probs_gives_completion_probabilities(whole_pool):
    body = {"prompt": TEXT, "n_predict": 4, "n_probs": 3, "return_tokens": True,
            **GREEDY}
    out = _post(whole_pool, "/completion", body).json()
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    for p in probs:
        assert len(p["top_logprobs"]) == 3
        assert p["logprob"] <= 0 and bytes(p["bytes"]).decode("utf-8", "replace")
        # Greedy: the chosen token is the most likely one.
        assert p["id"] == p["top_logprobs"][0]["id"]
    with httpx.stream("POST", whole_pool.url + "/completion",
                      json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        events = sse_events(r.iter_lines())
    streamed = [p for e in events for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == out["tokens"]


def test_stop_type_word_and_eos(whole_pool):
    # A grammar fixes the output, so the stop string surely comes.
    r = _post(whole_pool, "/completion", {"prompt": "x", "n_predict": 20,
                                          "grammar": 'root ::= "abcabc"',
                                          "stop": ["ca"]})
    out = r.json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == (
        "ab", "word", "ca")
    r = _post(whole_pool, "/completion", {"prompt": "x", "n_predict": 20,
                                          "grammar": 'root ::= "ab"'})
    out = r.json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == (
        "ab", "eos", "")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"prompt": "x", "response_fields": "content"}, "response_fields"),
    ({"prompt": "x", "stream_options": {}}, "stream_options"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, -4]}, "prompt"),
    ({"prompt": "x", "id_slot": "0"}, "id_slot"),
    ({"prompt": "x", "cache_prompt": 0}, "cache_prompt"),
    ({"prompt": [10**7]}, None),  # checked by the worker (vocabulary)
])
def test_completion_bad_fields_are_400s_naming_them(whole_pool, body, param):
    error = _error(_post(whole_pool, "/completion", body), 400)
    if param is not None:
        assert error["param"] == param


def test_a_prompt_longer_than_the_context_is_refused(whole_pool):
    error = _error(_post(whole_pool, "/completion", {"prompt": [300] * 2048}), 400)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body, param", [
    ("/completion", {"prompt": [300] * 2048}, "prompt"),
    ("/completion", {"prompt": "hello " * 3000}, "prompt"),
    ("/v1/completions", {"prompt": "hello " * 3000}, "prompt"),
])
def test_a_prompt_too_long_has_one_shape_on_every_endpoint(whole_pool, path, body,
                                                           param):
    """llama.cpp's body, with both sizes, wherever the frontend finds the
    prompt too long (the native endpoints answered a plain
    ``invalid_request_error`` without the sizes)."""
    error = _error(_post(whole_pool, path, body), 400)
    assert (error["type"], error["code"], error["param"]) == (
        "exceed_context_size_error", "context_length_exceeded", param)
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] >= 2048


# --- id_slot ----------------------------------------------------------------------


def _slot_ids(pool: Pool) -> list[int]:
    return sorted(s["id"] for s in httpx.get(pool.url + "/slots").json())


def test_id_slot_leases_exactly_that_slot(whole_pool):
    ids = _slot_ids(whole_pool)
    assert len(ids) == 2
    for slot in ids + list(reversed(ids)):
        r = _post(whole_pool, "/completion",
                  {"prompt": "Hi", "n_predict": 1, "id_slot": slot})
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] == slot == int(r.headers["X-Slot-Id"])
    error = _error(_post(whole_pool, "/completion",
                         {"prompt": "Hi", "id_slot": max(ids) + 100}), 400)
    assert error["message"] == "Invalid slot ID"


def test_id_slot_of_a_busy_slot_is_a_503_while_another_is_free(whole_pool):
    ids = _slot_ids(whole_pool)
    body = {"prompt": "Hi", "n_predict": 2000, "ignore_eos": True, "stream": True,
            "id_slot": ids[0]}
    # A client that stops reading: its job pauses for credit, its slot busy.
    held = RawStream(whole_pool.port, body, path="/completion")
    try:
        assert int(held.header("X-Slot-Id")) == ids[0]
        wait_paused(whole_pool, ids[0])
        r = _post(whole_pool, "/completion",
                  {"prompt": "Hi", "n_predict": 1, "id_slot": ids[0]})
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        other = _post(whole_pool, "/completion",
                      {"prompt": "Hi", "n_predict": 1, "id_slot": ids[1]})
        assert other.status_code == 200 and other.json()["id_slot"] == ids[1]
    finally:
        held.close()


# --- cache_prompt -----------------------------------------------------------------


def test_cache_prompt_false_reuses_nothing(whole_pool):
    slot = _slot_ids(whole_pool)[0]
    ids = _tokens(whole_pool, " ".join([TEXT] * 8), add_special=True)
    body = {"prompt": ids, "n_predict": 2, "id_slot": slot}

    def cached(**extra) -> int:
        r = _post(whole_pool, "/completion", {**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["timings"]["cache_n"]

    cached()  # the slot's cache now holds the prompt
    assert cached() > len(ids) // 2
    assert cached(cache_prompt=False) == 0
    assert cached(cache_prompt=True) > len(ids) // 2


# --- /infill ----------------------------------------------------------------------


def test_infill_without_fim_tokens_is_a_clear_400(whole_pool):
    before = _submitted(whole_pool)
    error = _error(_post(whole_pool, "/infill",
                         {"input_prefix": "def f(", "input_suffix": "):"}), 400)
    assert error["message"] == ("Infill is not supported by this model: prefix "
                                "token is missing. suffix token is missing. "
                                "middle token is missing. ")  # llama.cpp's
    assert _submitted(whole_pool) == before


@pytest.fixture(scope="module")
def fim_pool(tmp_path_factory, pool_factory):
    """One worker and a frontend on a tiny model that has FIM tokens."""
    path = tmp_path_factory.mktemp("fim") / "fim.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model", "--fim",
                    str(path)], check=True, capture_output=True)
    with pool_factory(model=path, workers=1) as pool:
        yield pool


def test_infill_lays_out_the_fim_prompt(fim_pool):
    body = {"input_prefix": "def f(", "input_suffix": "):", "prompt": "x",
            "input_extra": [{"filename": "a.py", "text": "hello"}],
            "n_predict": 3, "return_tokens": True}
    r = _post(fim_pool, "/infill", body)
    assert r.status_code == 200, r.text
    out = r.json()
    pre, suf, mid = FIM_PIECES
    prompt = out["prompt"]
    # extra chunk, BOS, prefix + prompt, suffix, then the middle token last.
    assert prompt.index("hello") < prompt.index("<s>") < prompt.index(pre)
    assert prompt.index(pre) < prompt.index("def f(") < prompt.index(" x")
    assert prompt.index(" x") < prompt.index(suf) < prompt.index("):")
    assert prompt.endswith(mid)
    # Each text is tokenised on its own (no BOS), between 4 special tokens.
    texts = ["\n\n--- snippet ---\n\n", "hello", "def f(", "x", "):"]
    assert out["tokens_evaluated"] == 4 + sum(
        len(_tokens(fim_pool, t, parse_special=False)) for t in texts)
    assert out["tokens_predicted"] == len(out["tokens"]) <= 3
    missing = _post(fim_pool, "/infill", {"input_suffix": "x"})
    assert _error(missing, 400)["param"] == "input_prefix"
    # Too long: llama.cpp's body with both sizes, as on every endpoint.
    error = _error(_post(fim_pool, "/infill", {"input_prefix": "hello " * 3000,
                                               "input_suffix": "x"}), 400)
    assert (error["type"], error["param"]) == ("exceed_context_size_error",
                                               "input_prefix")
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] >= 2048
    fim_pool.assert_whole()


# --- a frontend without the model file --------------------------------------------


#: A frontend started without ``--model``: no vocabulary of its own.
bare_pool = pool_fixture(workers=1, frontend_tokenizes=False)


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"content": "Hi"}),
    ("/detokenize", {"tokens": [5]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b"}),
    ("/completion", {"prompt": [BOS_ID, "Hi"]}),
])
def test_without_the_vocabulary_a_501_names_the_setting(bare_pool, path, body):
    error = _error(_post(bare_pool, path, body), 501)
    assert "--model" in error["message"]
    assert "LLAMAPOOL_TOKENIZER_MODEL" in error["message"]


def test_without_the_vocabulary_text_and_id_prompts_still_work(bare_pool):
    r = _post(bare_pool, "/completion", {"prompt": TEXT, "n_predict": 2})
    assert r.status_code == 200, r.text
    n_text = r.json()["tokens_evaluated"]
    assert n_text > 5
    r = _post(bare_pool, "/completion", {"prompt": [BOS_ID, 300, 301],
                                         "n_predict": 2})
    assert r.json()["tokens_evaluated"] == 3
    props = httpx.get(bare_pool.url + "/props", timeout=TIMEOUT_S).json()
    assert props["total_slots"] == 1 and props["chat_template"] == ""
    bare_pool.assert_whole()


def test_native_bodies_are_json_objects(whole_pool):
    r = httpx.post(whole_pool.url + "/completion", content=json.dumps([1, 2]),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    assert r.status_code == 400
