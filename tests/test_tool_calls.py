"""Tool calling on the chat endpoint, through real pools (issue 11, section 3).

Two test models: the usual tiny GGUF, whose chat template never mentions
tools, and the same weights with a template that renders them
(``make-test-model --tools-template``). The tiny model is random, so a call
is forced with ``tool_choice`` (required, or a named function), whose
grammar makes the output exactly one valid call; the shape OpenAI's client
reads is checked, whole and streamed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.pool import Pool, sse_events
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools-model") / "tiny-tools.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    "--tools-template", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def tools_pool(tools_model, pool_factory):
    with pool_factory(model=tools_model, workers=1) as p:
        yield p


#: The tiny model's template has no tools; the frontend renders prompts.
plain_pool = pool_fixture(workers=1)


#: Same, but the worker renders the prompt (the frontend has no model).
plain_ungated_pool = pool_fixture(workers=1, frontend_tokenizes=False)


def chat(pool: Pool, body: dict) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions",
                      json={"messages": ASK, "max_tokens": 256, **body}, timeout=60)


def client(pool: Pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def assert_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments in ({"unit": "celsius"}, {"unit": "fahrenheit"})


# --- a template without tool support ---------------------------------------------


def test_tool_choice_none_is_answered_normally(plain_pool):
    r = chat(plain_pool, {"tools": [WEATHER], "tool_choice": "none",
                          "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str)


@pytest.mark.parametrize("where", ["frontend", "worker"])
@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_tools_with_a_template_without_them_get_a_clear_400(
        request, where, choice):
    pool = request.getfixturevalue(
        "plain_pool" if where == "frontend" else "plain_ungated_pool")
    body = {"tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    r = chat(pool, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "tools_unsupported"
    assert "does not support tools" in error["message"]
    pool.assert_whole()


# --- a template that renders tools -------------------------------------------------


def test_tools_reach_the_prompt(tools_pool):
    offered = chat(tools_pool, {"tools": [WEATHER], "max_tokens": 1}).json()
    withheld = chat(tools_pool, {"tools": [WEATHER], "tool_choice": "none",
                                 "max_tokens": 1}).json()
    # The template rendered the tool list into the prompt, or did not.
    assert offered["usage"]["prompt_tokens"] > withheld["usage"]["prompt_tokens"] + 10


def test_required_tool_choice_returns_tool_calls(tools_pool):
    out = client(tools_pool).chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=256)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_weather_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called(tools_pool):
    out = client(tools_pool).chat.completions.create(
        model="x", messages=ASK, tools=[TIME, WEATHER], max_tokens=256,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert out.choices[0].finish_reason == "tool_calls"
    assert_weather_call(out.choices[0].message.tool_calls[0])


def test_streamed_tool_calls_in_openai_shape(tools_pool):
    chunks = list(client(tools_pool).chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=256, stream=True))
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", None)
    deltas = [c.choices[0].delta for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1
    call = deltas[0].tool_calls[0]
    assert call.index == 0
    assert_weather_call(call)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_raw(tools_pool):
    with httpx.stream("POST", tools_pool.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 256, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    calls = [e for e in events[:-1] if "tool_calls" in e["choices"][0]["delta"]]
    assert len(calls) == 1
    (call,) = calls[0]["choices"][0]["delta"]["tool_calls"]
    assert set(call) == {"index", "id", "type", "function"}
    assert set(call["function"]) == {"name", "arguments"}


def test_auto_answers_in_a_valid_shape(tools_pool):
    r = chat(tools_pool, {"tools": [WEATHER], "max_tokens": 8})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    # A random model rarely writes a call by itself: either shape is fine,
    # but it is one or the other, complete.
    if "tool_calls" in message:
        assert choice["finish_reason"] in ("tool_calls", "length")
    else:
        assert isinstance(message["content"], str)


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_bad_tool_fields_are_400_naming_them(tools_pool, body, param):
    r = chat(tools_pool, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_conversation_continues_after_a_tool_call(tools_pool):
    """The client sends the call back (assistant ``tool_calls``) with the
    tool's answer; the template is shown the call in the taught form."""
    first = client(tools_pool).chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=256)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name,
                                 "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    answered = chat(tools_pool, {"messages": history, "tools": [WEATHER],
                                 "max_tokens": 4, "ignore_eos": True})
    assert answered.status_code == 200, answered.text
    no_call = [*ASK, {"role": "assistant", "content": None},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    without = chat(tools_pool, {"messages": no_call, "tools": [WEATHER],
                                "max_tokens": 4, "ignore_eos": True})
    # The call's text is in the prompt: the name, the arguments, the markers.
    assert (answered.json()["usage"]["prompt_tokens"]
            > without.json()["usage"]["prompt_tokens"] + 10)
    bad = [*ASK, {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": "{not json"}}]}]
    r = chat(tools_pool, {"messages": bad, "tools": [WEATHER]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
