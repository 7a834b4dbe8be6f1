"""Fields that shape the output, through a real pool (issue 11, section 1).

``response_format``, ``json_schema``, ``grammar``, ``logit_bias``,
``logprobs``/``top_logprobs``/``n_probs`` and ``n_predict`` all work, with the
real ``openai`` client where the field is OpenAI's; anything invalid, or a
field the server does not implement, is a 400 naming the field that never
takes a slot. The tiny model has random weights: only a grammar makes its
output JSON, so a parsed, schema-valid answer proves the grammar was applied.
"""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest

from llamapool.test_model import EOS_ID
from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest
from workers.model.engine import RequestRejected
from workers.model.features import refuse_unsupported
from workers.model.llama_engine import LlamaEngine
from workers.model.synthetic_engine import SyntheticEngine

pytestmark = pytest.mark.stack

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture
def client(whole_pool):
    return openai.OpenAI(base_url=whole_pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def _submitted(pool) -> int:
    return pool.status()["counters"].get("submitted", 0)


# --- constrained output --------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_answer_validates(client, temperature):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Who?"}],
        temperature=temperature, max_tokens=300, seed=7,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def _streamed_chat(client, **kw) -> tuple[str, str]:
    chunks = list(client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], stream=True,
        **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


def test_streamed_json_object(client):
    """``json_object`` with llama.cpp's ``schema`` extension parses and
    validates. Without one, any object is allowed, and a random model's
    strings never end: the output is only checked to start as an object."""
    text, reason = _streamed_chat(
        client, max_tokens=300, temperature=0.9, seed=3,
        response_format={"type": "json_object", "schema": PERSON})
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    text, _ = _streamed_chat(client, max_tokens=10, temperature=0.9, seed=3,
                             response_format={"type": "json_object"})
    assert text.startswith("{"), text


def test_native_json_schema_on_completions(whole_pool):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2,
              "maxItems": 4}
    r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
        "prompt": "Numbers:", "json_schema": schema, "n_predict": 200,
        "temperature": 0.7, "seed": 1})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_gbnf_grammar_is_obeyed(whole_pool):
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]'
    for seed in range(3):
        r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
            "prompt": "Answer:", "grammar": grammar, "max_tokens": 50,
            "temperature": 1.0, "seed": seed})
        text = r.json()["choices"][0]["text"]
        assert text[:-3] in ("yes", "no") and text[-3] == " ", text
        assert text[-2:].isdigit() and r.json()["choices"][0]["finish_reason"] \
            == "stop"


def test_grammar_dead_end_stops_and_the_worker_lives(whole_pool):
    """A grammar that admits no token (a NUL byte), or whose only way out is
    the end token that ``ignore_eos`` bans: generation stops, no crash."""
    for body in ({"grammar": 'root ::= "\\x00"'},
                 {"grammar": 'root ::= "ok"', "ignore_eos": True}):
        r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 20, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    whole_pool.assert_whole()
    assert "abort" not in whole_pool.logs().lower()


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "sound"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "frobnicate"}}}}, "response_format.json_schema.schema"),
    ({"json_schema": {"type": "string", "pattern": "no-anchors"}}, "json_schema"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "json_schema"),
    ({"json_schema": {"type": "array", "maxItems": 10**9}}, "json_schema"),
    ({"json_schema": "object"}, "json_schema"),
    ({"grammar": "root ::= undefined-rule"}, "grammar"),
    ({"grammar": "root ::= root \"a\""}, "grammar"),
    ({"grammar": 'root ::= "a"{5000}'}, "grammar"),
    ({"grammar": 5}, "grammar"),
    # llama.cpp's parser recurses per level: this deep, it would kill the
    # frontend process (SIGSEGV) if it were handed over.
    ({"grammar": "root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000}, "grammar"),
    ({"grammar": 'root ::= "a"' + " " * 70_000}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
    ({"logit_bias": 7}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 2, "stop": ["x" * 300]}, "stop"),
    ({"n_probs": -1}, "n_probs"),
    ({"n_predict": -2}, "n_predict"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"cache_prompt": False}, "cache_prompt"),
    ({"echo": True}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_invalid_output_field_is_400_before_a_slot(whole_pool, body, param):
    before = _submitted(whole_pool)
    r = httpx.post(whole_pool.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert _submitted(whole_pool) == before


def test_logit_bias_beyond_the_vocabulary_is_a_400_from_the_worker(whole_pool):
    """Only the worker knows the vocabulary's size: it refuses an id beyond
    it, and the client gets a 400 (from the error table), not a 500."""
    r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": 4, "logit_bias": {"999999": 5}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsupported_field"


def test_chat_invalid_fields(whole_pool):
    for body, param in [({"top_logprobs": 3}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"audio": {"voice": "x"}}, "audio")]:
        r = httpx.post(whole_pool.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_ignored_on_purpose_and_no_op_fields_are_accepted(client):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        user="u-1", metadata={"k": "v"}, store=False, tool_choice="none",
        extra_body={"cache_prompt": True, "mirostat": 0, "mirostat_tau": 5.0,
                    "typical_p": 1.0, "id_slot": -1, "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 2


# --- logit_bias ------------------------------------------------------------------


def test_logit_bias_by_token_id(client):
    base = dict(model="x", prompt="Hello", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**base)
    forced = client.completions.create(**base, logit_bias={"320": 100})
    # Token 320 of the test vocabulary is "8".
    assert forced.choices[0].text == "8" * 6 != plain.choices[0].text


def test_logit_bias_text_key_and_false(whole_pool):
    """A text key biases each of its tokens ("world" is one token here); in
    the list form a later entry wins, and ``false`` means never."""
    def text(bias):
        r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "logit_bias": bias})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text({"world": 100}) == " world" * 4
    assert "world" not in text([["world", 100], ["world", False]])


def test_logit_bias_on_the_end_token(whole_pool):
    """A high bias on the end token ends at once; ``false`` after it in the
    list form bans it, and generation runs to ``max_tokens``."""
    def usage(bias):
        r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 30, "temperature": 1.0, "seed": 4,
            "logit_bias": bias})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    assert usage({str(EOS_ID): 100}) == 0
    assert usage([[EOS_ID, 100], [EOS_ID, False]]) == 30


# --- logprobs --------------------------------------------------------------------


def _check_chat_entries(entries, n_top):
    assert entries
    for e in entries:
        assert e.logprob <= 0 and math.isfinite(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert len(e.top_logprobs) == n_top
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        if n_top:
            assert e.logprob <= lps[0] + 1e-9


def test_chat_logprobs_whole_and_streamed(client):
    kw = dict(model="x", messages=[{"role": "user", "content": "Hi"}],
              max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    _check_chat_entries(content, 3)
    # Greedy: the chosen token is the most likely one.
    assert all(e.token == e.top_logprobs[0].token for e in content)
    assert "".join(e.token for e in content) == out.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [
        (e.token, round(e.logprob, 6)) for e in content]


def test_completion_logprobs_legacy_shape(client):
    out = client.completions.create(model="x", prompt="Hello", max_tokens=5,
                                    temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chunks = list(client.completions.create(
        model="x", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
        stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_logprobs_of_tokens_held_behind_a_long_stop_prefix(whole_pool):
    """A stop string that never completes holds its matching prefix back; the
    held tokens' entries go out together at the end, within the wire's
    per-frame limit."""
    greedy = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
        "prompt": "Hello", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]["text"]
    stop = greedy + "x" * (256 - len(greedy))  # all of it is a prefix
    r = httpx.post(whole_pool.url + "/v1/completions", timeout=60, json={
        "prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "logprobs": 20, "stop": [stop]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == greedy
    assert len(choice["logprobs"]["tokens"]) == 40


def test_native_n_probs_and_no_logprobs_by_default(whole_pool):
    r = httpx.post(whole_pool.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "n_probs": 2, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)
    r = httpx.post(whole_pool.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.json()["choices"][0]["logprobs"] is None


# --- n_predict -------------------------------------------------------------------


def test_n_predict_overrides_max_tokens(whole_pool):
    for path, body in [("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}]})]:
        r = httpx.post(whole_pool.url + path, timeout=60, json={
            **body, "max_tokens": 2, "n_predict": 7, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 7, r.text


# --- engines never ignore the fields either ---------------------------------------


class _Sink:
    def emit(self, *args, **kwargs):
        pass

    def should_stop(self):
        return False

    def wait_for_credit(self):
        return True

    def report_progress(self, *args):
        pass

    def threads_to_use(self, current: int) -> int:
        return current


def test_worker_refuses_a_grammar_its_vocabulary_cannot_compile(tiny_model):
    """The frontend cannot resolve a token written as text (``<hello>``); the
    worker tokenises it and refuses, with a code the frontend shows as 400, a
    text that is not exactly one token."""
    engine = LlamaEngine(str(tiny_model), n_ctx=256, n_threads=1)
    with pytest.raises(RequestRejected) as refused:
        engine.run(GenerationRequest("completion", "Hi", max_tokens=2,
                                     grammar="root ::= <not-one-token>"), _Sink())
    assert refused.value.code == ErrorCode.INVALID_GRAMMAR
    result = engine.run(GenerationRequest("completion", "Hi", max_tokens=2,
                                          grammar="root ::= <[320]>"), _Sink())
    assert result.finish_reason == "stop" and result.completion_tokens == 1


@pytest.mark.parametrize("field", [{"grammar": 'root ::= "a"'}, {"logprobs": 2}])
def test_synthetic_engine_refuses_what_needs_a_model(field):
    """The worker's one features check (``workers.model.features``) refuses
    for the engine, before its ``run`` (tests/test_worker_link.py drives it
    through the job runner)."""
    engine = SyntheticEngine(tokens_per_second=1000)
    with pytest.raises(RequestRejected) as refused:
        refuse_unsupported(
            GenerationRequest("completion", "Hi", max_tokens=2, **field),
            engine.name, engine.features)
    assert refused.value.code == ErrorCode.UNSUPPORTED_FIELD
