"""Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` through real
processes, with the real ``anthropic`` and ``openai`` clients (issue 33).

The model is the tiny one with a template that renders tools
(``make-test-model --tools-template``); it is random, so a call is forced
with ``tool_choice`` (Anthropic's ``any`` or ``tool``, OpenAI's
``required`` or a named function), whose grammar makes the output exactly
one valid call.
"""

from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from tests.pool import Pool
from tests.pool_factory import pool_fixture
from tests.test_http_edges import KEY
from tests.test_slot_paths import hold_slot

pytestmark = pytest.mark.stack

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"unit": {"enum": ["celsius",
                                                             "fahrenheit"]}},
                            "required": ["unit"]}}
FN_WEATHER = {"type": "function", "name": "get_weather",
              "parameters": WEATHER["input_schema"]}
ASK = [{"role": "user", "content": "What is the weather?"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; "


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent-model") / "tiny-tools.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    "--tools-template", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def pool(tools_model, pool_factory):
    with pool_factory(model=tools_model, workers=1) as p:
        yield p


#: The tiny model, the worker renders every prompt (as
#: ``tests.test_tool_calls`` starts it, so the two share one pool).
ungated_pool = pool_fixture(workers=1, frontend_tokenizes=False)

#: As ``tests.test_http_edges`` starts it, so the two share one pool.
keyed_pool = pool_fixture(workers=1, api_keys=(KEY, "second-key"),
                          frontend_env={"LLAMAPOOL_MAX_BODY_BYTES": "65536"})


def claude(pool: Pool, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pool.url, api_key=key, max_retries=0,
                               timeout=60)


def oai(pool: Pool, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url + "/v1", api_key=key, max_retries=0,
                         timeout=60)


def event_types(body: str) -> list[str]:
    return [line.removeprefix("event: ") for line in body.splitlines()
            if line.startswith("event: ")]


# --- /v1/messages -----------------------------------------------------------------


def test_message_whole(pool):
    out = claude(pool).messages.create(model="m", max_tokens=8, messages=ASK,
                                       metadata={"user_id": "u1"})
    assert out.type == "message" and out.role == "assistant"
    assert out.id.startswith("msg_")
    assert out.stop_reason == "max_tokens"
    assert [b.type for b in out.content] == ["text"] and out.content[0].text
    assert out.usage.output_tokens == 8
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > 5
    pool.assert_whole()


def test_message_streamed_is_the_whole_message(pool):
    body = {"model": "m", "max_tokens": 12, "messages": ASK,
            "temperature": 0, "stream": True}
    r = httpx.post(pool.url + "/v1/messages", json=body, timeout=60,
                   headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["content-type"].startswith(
        "text/event-stream")
    kinds = event_types(r.text)
    assert kinds[:4] == ["message_start", "ping", "content_block_start",
                         "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    # The SDK's own accumulation of the same request.
    # This SDK's typed parameters no longer have the samplers: extra_body.
    with claude(pool).messages.stream(model="m", max_tokens=12, messages=ASK,
                                      extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    whole = claude(pool).messages.create(model="m", max_tokens=12,
                                         messages=ASK,
                                         extra_body={"temperature": 0})
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_stop_sequence_is_named(pool):
    out = claude(pool).messages.create(model="m", max_tokens=64, messages=ASK,
                                       extra_body={"temperature": 0},
                                       stop_sequences=[" "])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == " "
    assert " " not in "".join(b.text for b in out.content)


def test_forced_tool_use_whole_and_streamed(pool):
    client = claude(pool)
    out = client.messages.create(model="m", max_tokens=256, messages=ASK,
                                 tools=[WEATHER], tool_choice={"type": "any"})
    assert out.stop_reason == "tool_use"
    [call] = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    with client.messages.stream(model="m", max_tokens=256, messages=ASK,
                                tools=[WEATHER], tool_choice={
                                    "type": "tool", "name": "get_weather"}
                                ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert deltas, [e.type for e in events]
    assert final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use"
    assert final.content[-1].input in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    pool.assert_whole()


def test_output_config_json_schema(pool):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    out = claude(pool).messages.create(
        model="m", max_tokens=64, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(out.content[0].text)["n"], int)
    assert out.stop_reason == "end_turn"


def test_tool_round_trip_and_count_tokens(pool):
    client = claude(pool)
    first = client.messages.create(model="m", max_tokens=256, messages=ASK,
                                   tools=[WEATHER], tool_choice={"type": "any"})
    call = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK,
               {"role": "assistant", "content": [b.model_dump(
                   include={"type", "id", "name", "input"}) for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id,
                    "content": "21 degrees"},
                   {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model="m", max_tokens=4, messages=history,
                                    tools=[WEATHER], system="Be brief.")
    used = second.usage.input_tokens + second.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="m", messages=history,
                                           tools=[WEATHER], system="Be brief.")
    assert counted.input_tokens == used
    # The first turn's prompt is a prefix of the second's: it was reused.
    assert second.usage.cache_read_input_tokens > 100


def test_attribution_line_does_not_defeat_the_prompt_cache(pool):
    client = claude(pool)

    def ask(nonce: str):
        system = [{"type": "text", "text": BILLING + f"cch={nonce};"},
                  {"type": "text", "text": "You are a careful assistant. " * 20}]
        return client.messages.create(model="m", max_tokens=2, system=system,
                                      messages=ASK)

    ask("aaaaa")
    again = ask("bbbbb")
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    # All but the last few tokens came from the cache, despite the new nonce.
    assert again.usage.cache_read_input_tokens >= total - 2
    with_line = client.messages.count_tokens(
        model="m", messages=ASK,
        system=[{"type": "text", "text": BILLING + "cch=ccccc;"}])
    without = client.messages.count_tokens(model="m", messages=ASK)
    assert with_line.input_tokens == without.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "top_a": 1}, "top_a"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": ASK, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    # A prefill is continued (tests/test_chat_templates.py); one that calls
    # a tool has nothing to continue.
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]},
     "messages[1]"),
    ({"max_tokens": 4, "messages": ASK,
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
])
def test_bad_messages_get_anthropic_400s(pool, body, param):
    r = httpx.post(pool.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]


def test_sdk_sees_bad_request_and_not_found(pool):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(pool).messages.create(model="m", max_tokens=4, messages=ASK,
                                     extra_body={"top_k": -1})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(pool.url + "/v1/messages/batches", json={}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_a_full_pool_is_overloaded_with_retry_after(pool):
    stream, _ = hold_slot(pool)
    try:
        with pytest.raises(anthropic.APIStatusError) as caught:
            claude(pool).messages.create(model="m", max_tokens=4, messages=ASK)
        response = caught.value.response
        assert response.status_code == 529
        assert int(response.headers["Retry-After"]) >= 1
        assert caught.value.body["error"]["type"] == "overloaded_error"
    finally:
        stream.close()
    pool.assert_whole()


def test_keys_in_x_api_key_and_anthropic_401(keyed_pool):
    out = claude(keyed_pool, KEY).messages.create(model="m", max_tokens=2,
                                                  messages=ASK)
    assert out.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude(keyed_pool, "wrong").messages.create(model="m", max_tokens=2,
                                                    messages=ASK)
    assert caught.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Invalid API Key"}}
    # The OpenAI routes keep OpenAI's shape.
    with pytest.raises(openai.AuthenticationError) as caught:
        oai(keyed_pool, "wrong").responses.create(model="m", input="hi")
    assert caught.value.body["type"] == "authentication_error"


# --- /v1/responses ----------------------------------------------------------------


def test_response_whole(pool):
    out = oai(pool).responses.create(model="m", input="Hello there",
                                     instructions="Be brief.",
                                     max_output_tokens=6, store=False)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output_text
    assert out.usage.output_tokens == 6
    assert out.instructions == "Be brief." and out.store is False
    counted = oai(pool).responses.input_tokens.count(
        model="m", input="Hello there", instructions="Be brief.")
    assert counted.input_tokens == out.usage.input_tokens


def test_response_streamed_event_sequence(pool):
    events = list(oai(pool).responses.create(
        model="m", input="Hello there", max_output_tokens=6, stream=True,
        temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added",
                         "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = oai(pool).responses.create(model="m", input="Hello there",
                                       max_output_tokens=6, temperature=0)
    assert text == whole.output_text == events[-1].response.output_text


def test_function_call_round_trip(pool):
    client = oai(pool)
    out = client.responses.create(model="m", input="What is the weather?",
                                  tools=[FN_WEATHER], tool_choice="required")
    assert out.status == "completed"
    [call] = [i for i in out.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) in ({"unit": "celsius"},
                                          {"unit": "fahrenheit"})
    follow = [{"role": "user", "content": "What is the weather?"},
              {"type": "function_call", "call_id": call.call_id,
               "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": "21 degrees"}]
    second = client.responses.create(model="m", input=follow, tools=[FN_WEATHER],
                                     max_output_tokens=3)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens_details.cached_tokens > 100
    assert client.responses.input_tokens.count(
        model="m", input=follow, tools=[FN_WEATHER]).input_tokens == (
            second.usage.input_tokens)


def test_function_call_streamed(pool):
    events = list(oai(pool).responses.create(
        model="m", input="What is the weather?", tools=[FN_WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events
                if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["unit"] in ("celsius", "fahrenheit")
    assert kinds[-1] == "response.completed"
    assert events[-1].response.output[-1].type == "function_call"


def test_text_format_json_schema(pool):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    out = oai(pool).responses.create(
        model="m", input="A number", max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                         "strict": True}})
    assert isinstance(json.loads(out.output_text)["n"], int)


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_responses_get_400s(pool, extra, param):
    body = {"model": "m", "input": "hi", **extra}
    r = httpx.post(pool.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param in ("store", "previous_response_id"):
        assert "stateless" in error["message"]


def test_without_the_vocabulary_a_worker_counts_and_answers_work(ungated_pool):
    # Issue 34, item 8: no vocabulary at the door, a worker counts (a job
    # with nothing to generate), where this frontend answered 501.
    pool = ungated_pool
    out = claude(pool).messages.create(model="m", max_tokens=3, messages=ASK)
    assert out.usage.output_tokens == 3
    counted = claude(pool).messages.count_tokens(model="m", messages=ASK)
    assert counted.input_tokens == (out.usage.input_tokens
                                    + out.usage.cache_read_input_tokens)
    assert oai(pool).responses.input_tokens.count(model="m",
                                                  input="hi").input_tokens > 0
    assert oai(pool).responses.create(model="m", input="hi",
                                      max_output_tokens=2).usage.output_tokens == 2
