"""Tool-call formats read from the template (issue 33, item 4): detection,
parsing whole and streamed (any split of the stream reads the same), the
forced-call grammar in the model's own format, and history written back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.anthropic_format import MessagesShaper
from frontend.openai_format import ResponseShaper
from frontend.responses_format import ResponsesShaper
from frontend.tool_calls import loads_shallow, split_calls
from llamapool.test_model import TOOL_FORMAT_TEMPLATES
from protocol import messages, tool_formats
from protocol.payloads import Timings, Usage
from workers.model.grammar import check_gbnf
from workers.model.tool_grammar import call_grammar

USAGE = Usage(prompt_tokens=6, completion_tokens=3, total_tokens=9)
TIMINGS = Timings(prompt_n=6, prompt_ms=1.0, predicted_n=3, predicted_ms=1.0)

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                           "<｜tool▁call▁end｜>")

#: An answer in each format: text, then two calls (Llama 3's is calls only).
ANSWERS = {
    "hermes": 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
              '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
    "llama3": '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
              '{"name": "g", "parameters": {}}',
    "mistral": 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
               '{"name": "g", "arguments": {}}]',
    "mistral-v11": 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]x1[ARGS]{}',
    "command-r7b": 'Sure. <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", '
                   '"parameters": {"a": 1}}, {"tool_call_id": "1", "tool_name": '
                   '"g", "parameters": {}}]<|END_ACTION|>',
    "functionary-v3.1": 'Sure. <function=f>{"a": 1}</function>'
                        '<function=g>{}</function>',
    "deepseek-r1": "Sure. " + DS_CALLS + DS_CALL + "function" + DS_SEP
                   + 'f\n```json\n{"a": 1}\n```' + DS_END + DS_CALL + "function"
                   + DS_SEP + "g\n```json\n{}\n```" + DS_END + DS_CALLS_END,
}


def calls_of(found: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in found]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_format_reads_its_calls(name):
    content, calls = split_calls(ANSWERS[name], name)
    assert calls_of(calls) == [("f", {"a": 1}), ("g", {})]
    assert content == (None if name == "llama3" else "Sure.")


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_call_written_is_read_back(name):
    fmt = tool_formats.FORMATS[name]
    text = fmt.write("get_weather", '{"unit": "celsius"}')
    _, calls = fmt.split(text, loads_shallow)
    assert calls == [("get_weather", '{"unit": "celsius"}')]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_broken_calls_stay_text(name):
    text = ANSWERS[name].replace('{"a": 1}', '{"a": ')
    content, calls = split_calls(text, name)
    if name in ("hermes", "functionary-v3.1", "mistral-v11"):
        assert calls_of(calls) == [("g", {})]  # each call stands alone
    else:
        assert (content, calls) == (text, [])


def test_other_formats_markers_are_text():
    """A model is read in its own format only: another format's markers in
    its answer are text."""
    assert split_calls(ANSWERS["mistral"], "hermes") == (ANSWERS["mistral"], [])
    assert split_calls(ANSWERS["hermes"], "llama3") == (ANSWERS["hermes"], [])
    prose = 'Here is JSON: {"name": "f", "parameters": {}}'
    assert split_calls(prose, "llama3") == (prose, [])


def test_an_unnamed_format_is_hermes():
    """An older worker names no format: it had only Hermes'."""
    assert calls_of(split_calls(ANSWERS["hermes"], "")[1]) == [("f", {"a": 1}),
                                                              ("g", {})]


@pytest.mark.parametrize("template, expected", [
    *[(t, n) for n, t in TOOL_FORMAT_TEMPLATES.items()],
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("{% if tools %}use tools as you like{% endif %}", None),
    ("{{ tools }}<tool_call><function=x><parameter=y>", None),  # Qwen3-Coder
    ("{{ tools }}<|START_ACTION|>", "command-r7b"),
    ("{{ tools }}<function=name>", "functionary-v3.1"),
    ("{{ tools }}" + DS_CALLS, "deepseek-r1"),
])
def test_detection(template, expected):
    found = tool_formats.detect(template)
    assert (found.name if found else None) == expected


TOOLS = json.dumps([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"]}}},
    {"type": "function", "function": {"name": "get_time"}}])


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_forced_grammar_is_in_the_format(name):
    fmt = tool_formats.FORMATS[name]
    gbnf = call_grammar(fmt, TOOLS, "*")
    check_gbnf(gbnf)
    before, _ = fmt.around("get_weather")
    assert json.dumps(before) in gbnf
    named = call_grammar(fmt, TOOLS, "get_time")
    assert "get_weather" not in named and "f0-root" in named
    with pytest.raises(ValueError):
        call_grammar(fmt, TOOLS, "nope")


# --- streamed as whole: any split of the stream --------------------------------------

SPLITS = st.lists(st.integers(min_value=0, max_value=400), max_size=12)


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def final(fmt: str, text: str = "") -> messages.Final:
    return messages.Final("j", "stop", USAGE, TIMINGS, text=text, tool_format=fmt)


def sse(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_streamed(text: str, fmt: str, cuts: list[int]) -> list:
    shaper = ResponseShaper("chat", "r", "m", tools=True)
    pieces = chunks(text, cuts)
    body = b"".join(shaper.text_frame_event(messages.Token("j", p))
                    for p in pieces[:-1])
    body += shaper.final_frame_events(final(fmt, pieces[-1] if pieces else ""))
    calls, content = [], ""
    for event in sse(body):
        for choice in event.get("choices", []):
            delta = choice.get("delta", {})
            content += delta.get("content") or ""
            calls += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in delta.get("tool_calls", [])]
    return [content, calls]


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(ANSWERS)), cuts=SPLITS)
def test_chat_any_split_reads_as_the_whole(name, cuts):
    whole = ResponseShaper("chat", "r", "m", tools=True).whole_answer(
        ANSWERS[name], final(name))
    message = whole["choices"][0]["message"]
    expected = [message["content"] or "", calls_of(message["tool_calls"])]
    assert chat_streamed(ANSWERS[name], name, cuts) == expected
    assert whole["choices"][0]["finish_reason"] == "tool_calls"


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(ANSWERS)), cuts=SPLITS)
def test_messages_and_responses_any_split_reads_as_the_whole(name, cuts):
    pieces = chunks(ANSWERS[name], cuts) or [""]
    shaper = MessagesShaper("r", "m", tools=True)
    for p in pieces[:-1]:
        shaper.text_frame_event(messages.Token("j", p))
    body = shaper.final_frame_events(final(name, pieces[-1]))
    starts = [e for e in sse(body) if e.get("type") == "content_block_start"]
    names = [e["content_block"]["name"] for e in starts
             if e["content_block"]["type"] == "tool_use"]
    whole = MessagesShaper("r", "m", tools=True).whole_answer(ANSWERS[name],
                                                              final(name))
    assert names == [b["name"] for b in whole["content"] if b["type"] == "tool_use"]
    assert names == ["f", "g"]
    rshaper = ResponsesShaper("r", "m", {}, tools=True)
    for p in pieces[:-1]:
        rshaper.text_frame_event(messages.Token("j", p))
    events = [json.loads(line[6:]) for line in rshaper.final_frame_events(
        final(name, pieces[-1])).decode().splitlines() if line.startswith("data: ")]
    done = [e["item"]["name"] for e in events
            if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "function_call"]
    assert done == ["f", "g"]
