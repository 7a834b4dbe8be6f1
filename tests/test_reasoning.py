"""Reasoning kept apart from the answer, through real processes (issue 33).

The model is the tiny one with a reasoning template
(``REASONING_CHAT_TEMPLATE``): its prompt opens ``<think>``, so what the
random model writes is reasoning until it writes ``</think>``, which it
never does by chance; a grammar makes it write one where a test needs an
answer after the reasoning.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from llamapool.test_model import REASONING_CHAT_TEMPLATE, write_test_model
from tests.pool import Pool

pytestmark = pytest.mark.stack

ASK = [{"role": "user", "content": "Why?"}]
#: An answer after its reasoning, as a reasoning model writes it.
THOUGHT_THEN_ANSWER = 'root ::= "<think>plan</think>" "\\n\\n" "Hello"'


@pytest.fixture(scope="module")
def pool(tmp_path_factory, pool_factory):
    path = tmp_path_factory.mktemp("reasoning-model") / "tiny-reasoning.gguf"
    write_test_model(path, chat_template=REASONING_CHAT_TEMPLATE)
    with pool_factory(model=path, workers=1) as p:
        yield p


def chat(pool: Pool, **body) -> dict:
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 8, "temperature": 0,
                         **body})
    assert r.status_code == 200, r.text
    return r.json()


def oai(pool: Pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def claude(pool: Pool) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pool.url, api_key="unused",
                               max_retries=0, timeout=60)


def test_chat_reasoning_under_both_names_whole_and_streamed(pool):
    message = chat(pool)["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] != ""
    assert message["content"] == ""
    chunks = list(oai(pool).chat.completions.create(
        model="m", messages=ASK, max_tokens=8, temperature=0, stream=True))
    deltas = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert streamed == "".join(d.get("reasoning") or "" for d in deltas)
    assert streamed == message["reasoning_content"]


def test_answer_after_reasoning(pool):
    message = chat(pool, grammar=THOUGHT_THEN_ANSWER, max_tokens=64)[
        "choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "Hello")
    chunks = list(oai(pool).chat.completions.create(
        model="m", messages=ASK, max_tokens=64, stream=True,
        extra_body={"grammar": THOUGHT_THEN_ANSWER}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks
                      if c.choices)
    assert content == "Hello"


def test_reasoning_format_none_keeps_the_text_whole(pool):
    split = chat(pool, grammar=THOUGHT_THEN_ANSWER, max_tokens=64)
    whole = chat(pool, grammar=THOUGHT_THEN_ANSWER, max_tokens=64,
                 reasoning_format="none")["choices"][0]["message"]
    assert "reasoning_content" not in whole
    assert whole["content"] == "<think>plan</think>\n\nHello"
    assert split["choices"][0]["message"]["content"] == "Hello"
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=30, json={
        "messages": ASK, "reasoning_format": "deepseek-legacy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"


def test_enable_thinking_false_reaches_the_template(pool):
    thinking = chat(pool)
    off = chat(pool, chat_template_kwargs={"enable_thinking": False})
    message = off["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]
    # The template wrote its empty reasoning into the prompt.
    assert off["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=30, json={
        "messages": ASK, "chat_template_kwargs": {"enable_thoughts": False}})
    assert r.status_code == 400
    assert "enable_thoughts" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_earlier_reasoning_is_accepted_under_either_name(pool, name):
    history = [*ASK, {"role": "assistant", "content": "Because.",
                      name: "I was asked why."},
               {"role": "user", "content": "Sure?"}]
    bare = [*ASK, {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "Sure?"}]
    with_it = chat(pool, messages=history, max_tokens=1)["usage"]["prompt_tokens"]
    without = chat(pool, messages=bare, max_tokens=1)["usage"]["prompt_tokens"]
    assert with_it > without  # the template showed it


def test_thinking_blocks_on_messages(pool):
    client = claude(pool)
    out = client.messages.create(model="m", max_tokens=8, messages=ASK)
    assert [b.type for b in out.content] == ["thinking"]
    assert out.content[0].thinking and out.stop_reason == "max_tokens"
    with client.messages.stream(model="m", max_tokens=8, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta"
               for e in events)
    assert [b.type for b in final.content] == ["thinking"]
    off = client.messages.create(model="m", max_tokens=8, messages=ASK,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    counted = client.messages.count_tokens(model="m", messages=ASK,
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == (off.usage.input_tokens
                                    + off.usage.cache_read_input_tokens)


def test_forced_tool_use_on_a_reasoning_model(pool):
    tool = {"name": "f", "input_schema": {
        "type": "object", "properties": {"x": {"type": "integer"}},
        "required": ["x"]}}
    out = claude(pool).messages.create(model="m", max_tokens=128, messages=ASK,
                                       tools=[tool], tool_choice={"type": "any"})
    assert [b.type for b in out.content] == ["tool_use"]
    assert isinstance(out.content[0].input["x"], int)


def test_reasoning_items_on_responses(pool):
    client = oai(pool)
    out = client.responses.create(model="m", input="Why?", max_output_tokens=8)
    assert out.output[0].type == "reasoning"
    assert out.output[0].content[0].text
    events = list(client.responses.create(model="m", input="Why?",
                                          max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds
    assert events[-1].response.output[0].type == "reasoning"
    off = client.responses.create(model="m", input="Why?", max_output_tokens=8,
                                  reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"] and off.output_text
