"""Tool calls in the template's own format, through real processes, with the
real ``openai`` and ``anthropic`` clients (issue 33, item 4).

The tiny model, with templates teaching Llama 3's JSON calls and Mistral's
``[TOOL_CALLS]`` (both forms): ``make-test-model --tool-format NAME``. The
model is random, so a call is forced (``tool_choice``): the grammar must
write it in the model's format, and the answer must be read in it, on all
three APIs, whole and streamed; the call goes back in the history and the
next prompt shows it in the format again. Half the pools render prompts in
the frontend (it has the model file), half in the worker.
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

pytestmark = pytest.mark.stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"]}}}
ASK = [{"role": "user", "content": "What is the weather?"}]
UNITS = ({"unit": "celsius"}, {"unit": "fahrenheit"})
#: What each format's call looks like in a prompt.
MARKERS = {"llama3": '{"name": "get_weather", "parameters": {"unit": ',
           "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ',
           "mistral-v11": "[TOOL_CALLS]get_weather[ARGS]{"}


@pytest.fixture(scope="module", params=[("llama3", True), ("mistral", False),
                                        ("mistral-v11", True)],
                ids=["llama3-gated", "mistral-worker-renders", "mistral-v11-gated"])
def fmt_pool(request, tmp_path_factory, pool_factory):
    name, gated = request.param
    path = tmp_path_factory.mktemp("fmt") / f"tiny-{name}.gguf"
    subprocess.run([sys.executable, "-m", "llamapool", "make-test-model",
                    "--tool-format", name, str(path)], check=True,
                   capture_output=True)
    with pool_factory(model=path, workers=1, frontend_tokenizes=gated) as p:
        yield name, p


def oai(pool: Pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_chat_forced_call_whole_and_streamed(fmt_pool):
    name, pool = fmt_pool
    client = oai(pool)
    out = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                         tool_choice="required", max_tokens=256)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in UNITS
    stream = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], max_tokens=256, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) in UNITS
    pool.assert_whole()


def test_history_is_rendered_in_the_format(fmt_pool):
    """The call goes back as the client sends it, and the next prompt shows
    it as the model writes it (``/apply-template`` renders what chat does)."""
    name, pool = fmt_pool
    first = oai(pool).chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=256)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        call.model_dump()]}, {"role": "tool", "tool_call_id": call.id,
                              "content": "21 degrees"}]
    second = oai(pool).chat.completions.create(model="m", messages=history,
                                               tools=[WEATHER], max_tokens=3)
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")
    if name != "mistral":  # the gated pools have the template at the door
        shown = httpx.post(pool.url + "/apply-template", json={
            "messages": history, "tools": [WEATHER]}, timeout=30).json()["prompt"]
        assert MARKERS[name] in shown, shown


def test_anthropic_and_responses_read_the_format(fmt_pool):
    name, pool = fmt_pool
    claude = anthropic.Anthropic(base_url=pool.url, api_key="unused",
                                 max_retries=0, timeout=60)
    tool = {"name": "get_weather",
            "input_schema": WEATHER["function"]["parameters"]}
    out = claude.messages.create(model="m", max_tokens=256, messages=ASK,
                                 tools=[tool], tool_choice={"type": "any"})
    assert out.stop_reason == "tool_use"
    [use] = [b for b in out.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input in UNITS
    with claude.messages.stream(model="m", max_tokens=256, messages=ASK,
                                tools=[tool], tool_choice={
                                    "type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input in UNITS
    fn = {"type": "function", "name": "get_weather",
          "parameters": WEATHER["function"]["parameters"]}
    resp = oai(pool).responses.create(model="m", input="What is the weather?",
                                      tools=[fn], tool_choice="required")
    [item] = [i for i in resp.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) in UNITS
    events = list(oai(pool).responses.create(
        model="m", input="What is the weather?", tools=[fn], stream=True,
        tool_choice="required"))
    done = next(e for e in events
                if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) in UNITS
    pool.assert_whole()
