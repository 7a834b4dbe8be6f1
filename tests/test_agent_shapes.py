"""The Anthropic and Responses parsers and shapers, and the reasoning split,
without processes (issue 33). The same claims through real processes are in
tests/test_agent_apis.py and tests/test_reasoning.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend import anthropic_schema, responses_schema
from frontend.anthropic_format import MessagesShaper, error_shape
from frontend.errors import BadRequest, NoSlotAvailable, Unauthorized
from frontend.reasoning import ReasoningSplit, split_whole
from frontend.responses_format import ResponsesShaper
from protocol import messages
from protocol.payloads import Timings, Usage
from protocol.tool_formats import HERMES

USAGE = Usage(prompt_tokens=10, completion_tokens=3, total_tokens=13,
              cached_tokens=4)
TIMINGS = Timings(prompt_n=10, prompt_ms=1.0, predicted_n=3, predicted_ms=1.0)
ASK = [{"role": "user", "content": "hi"}]


def final(text: str = "", reason: str = "stop", word: str = "") -> messages.Final:
    return messages.Final("j", reason, USAGE, TIMINGS, text=text,
                          stopping_word=word)


def token(text: str) -> messages.Token:
    return messages.Token("j", text)


def sse(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines()
            if line.startswith("data: ")]


# --- reasoning ----------------------------------------------------------------------

PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ",
                          "\n", "a", "b c", "</th", "ink>", "<thi"])


@given(st.lists(PIECES, max_size=14), st.booleans(), st.data())
def test_any_split_of_a_stream_gives_the_whole_answer(pieces, opened, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    split = ReasoningSplit(opened)
    thought = content = ""
    at = 0
    for cut in [*cuts, len(text)]:
        t, c = split.feed(text[at:cut])
        thought, content, at = thought + t, content + c, cut
    t, c = split.finish()
    assert (thought + t, content + c) == split_whole(text, opened)


@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nplan\n</think>\n\nHello", False, ("plan", "Hello")),
    ("plan</think>Hello", True, ("plan", "Hello")),
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),
    ("cut off while think", True, ("cut off while think", "")),
    ("  <think>a", False, ("a", "")),
])
def test_split_whole(text, opened, expected):
    assert split_whole(text, opened) == expected


# --- Anthropic -----------------------------------------------------------------------


def test_messages_turns_tools_and_attribution():
    parsed = anthropic_schema.parse_messages({
        "model": "m", "max_tokens": 9, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: "
                    "cc_version=1; cch=abcde;"},
                   {"type": "text", "text": "Be kind.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                {"type": "text", "text": "next"}]}]})
    # Earlier calls travel as HistoryCall; as Hermes text, as a template
    # without a format of its own shows them.
    turns = [(m.role, m.content + "".join(HERMES.write(c.name, c.arguments)
                                          for c in m.tool_calls),
              m.reasoning_content) for m in parsed.generation.messages]
    assert turns == [
        ("system", "Be kind.", ""), ("user", "go", ""),
        ("assistant", '<tool_call>{"name": "f", "arguments": {"a": 1}}'
                      "</tool_call>", "hm"),
        ("tool", "ok", ""), ("user", "next", "")]
    assert parsed.tools and parsed.single_call and parsed.generation.force_call == "*"
    assert parsed.generation.max_tokens == 9


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 1, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "extra": 1}]}]}, "messages[0].content[0].extra"),
    ({"max_tokens": 1, "messages": ASK, "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ({"max_tokens": 2000, "messages": ASK,
      "thinking": {"type": "enabled", "budget_tokens": 4000}},
     "thinking.budget_tokens"),
    ({"max_tokens": 1, "messages": ASK, "mcp_servers": []}, "mcp_servers"),
])
def test_messages_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as caught:
        anthropic_schema.parse_messages(body)
    assert caught.value.param == param


def test_anthropic_error_shape():
    assert error_shape(Unauthorized()) == (401, {"type": "error", "error": {
        "type": "authentication_error", "message": "Invalid API Key"}})
    status, body = error_shape(NoSlotAvailable(3.0))
    assert (status, body["error"]["type"]) == (529, "overloaded_error")
    assert error_shape(BadRequest("x"))[1]["error"]["type"] == "invalid_request_error"


def test_messages_stream_with_thinking_and_a_call():
    shaper = MessagesShaper("r", "m", tools=True, reasoning=ReasoningSplit(True))
    body = shaper.text_frame_event(token("plan"))
    body += shaper.text_frame_event(token("</think><tool_call>"))
    body += shaper.final_frame_events(final(
        '{"name": "f", "arguments": {"a": 1}}</tool_call>'))
    events = sse(body)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop",  # thinking + signature
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[2]["content_block"]["type"] == "thinking"
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "plan"}
    assert events[6]["content_block"]["type"] == "tool_use"
    assert json.loads(events[7]["delta"]["partial_json"]) == {"a": 1}
    assert events[9]["delta"]["stop_reason"] == "tool_use"
    assert events[9]["usage"] == {"input_tokens": 6, "output_tokens": 3,
                                  "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 4}


def test_messages_pings_while_text_is_held():
    now = [0.0]
    shaper = MessagesShaper("r", "m", tools=True, clock=lambda: now[0])
    assert b"message_start" in shaper.text_frame_event(token("a"))
    assert shaper.text_frame_event(token("b")) == b""
    now[0] = 6.0
    assert sse(shaper.text_frame_event(token("c"))) == [{"type": "ping"}]
    assert shaper.text_frame_event(token("d")) == b""


def test_messages_stop_sequence_and_whole_thinking():
    shaper = MessagesShaper("r", "m", stop_sequences=("END",),
                            reasoning=ReasoningSplit(True))
    out = shaper.whole_answer("hm</think>Hi", final(word="END"))
    assert out["content"] == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "Hi"}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")


# --- Responses ----------------------------------------------------------------------


def test_responses_items_become_turns():
    parsed = responses_schema.parse_responses({
        "model": "m", "instructions": "sys", "store": False,
        "reasoning": {"effort": "none"}, "prompt_cache_key": "k",
        "input": [
            {"role": "developer", "content": "dev"},
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "reasoning", "id": "rs", "summary": [],
             "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "c", "name": "f",
             "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c", "output": "ok"}]})
    # Earlier calls travel as HistoryCall; as Hermes text, as a template
    # without a format of its own shows them.
    turns = [(m.role, m.content + "".join(HERMES.write(c.name, c.arguments)
                                          for c in m.tool_calls),
              m.reasoning_content) for m in parsed.generation.messages]
    assert turns == [("system", "sys", ""), ("system", "dev", ""),
                     ("user", "q", ""),
                     ("assistant", '<tool_call>{"name": "f", "arguments": '
                                   '{"a": 1}}</tool_call>', "hm"),
                     ("tool", "ok", "")]
    assert parsed.thinking is False


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"), ({"conversation": "c"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
])
def test_responses_refusals_name_the_field(extra, param):
    with pytest.raises(BadRequest) as caught:
        responses_schema.parse_responses({"input": "hi", **extra})
    assert caught.value.param == param


def test_responses_stream_reasoning_then_message():
    shaper = ResponsesShaper("r", "m", {}, reasoning=ReasoningSplit(True))
    body = shaper.text_frame_event(token("plan</th"))
    body += shaper.text_frame_event(token("ink>Hello"))
    body += shaper.final_frame_events(final(" there"))
    events = sse(body)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"][0]["text"] == "plan"
    assert done["output"][1]["content"][0]["text"] == "Hello there"
    assert events[8]["output_index"] == 1


def test_stream_errors_end_each_api_in_its_own_shape():
    events = sse(MessagesShaper("r", "m").error_event("no_slot", "full"))
    assert events == [{"type": "error", "error": {"type": "overloaded_error",
                                                   "message": "full"}}]
    shaper = ResponsesShaper("r", "m", {})
    events = sse(shaper.text_frame_event(token("a"))
                 + shaper.error_event("worker_died", "gone"))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "worker_died"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "gone"
