"""The official ``openai`` client against a real pool (broker, 2 workers, gunicorn)."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.stack


@pytest.fixture
def client(whole_pool):
    return openai.OpenAI(base_url=whole_pool.url + "/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_completion_whole(client):
    out = client.completions.create(model="any-name", prompt="Hello world",
                                    max_tokens=8, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.model == "tiny.gguf"  # the served model, whatever was asked
    assert isinstance(out.choices[0].text, str) and out.choices[0].text


def test_completion_streamed_with_usage(client):
    chunks = list(client.completions.create(
        model="x", prompt="Hello world", max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].usage.completion_tokens == 12
    assert chunks[-1].choices == []
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text


def test_completion_streamed_without_usage(client):
    chunks = list(client.completions.create(
        model="x", prompt="Hi", max_tokens=4, stream=True,
        extra_body={"ignore_eos": True},
    ))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole(client):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Say hello"}],
        max_tokens=6, extra_body={"ignore_eos": True},
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_chat_streamed(client):
    chunks = list(client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=10, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}


def test_max_tokens_zero_and_max_completion_tokens(client):
    out = client.completions.create(model="x", prompt="Hi", max_tokens=0)
    assert out.usage.completion_tokens == 0 and out.choices[0].text == ""
    chat = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3, extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3


def _greedy(client, prompt, stop=None, stream=False):
    kwargs = dict(model="x", prompt=prompt, max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True})
    if stop is not None:
        kwargs["stop"] = stop
    if not stream:
        out = client.completions.create(**kwargs)
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_never_leaks(client, stream):
    """Stop strings cut the output, even when they span several tokens.

    Greedy decoding makes the continuation reproducible: take a piece of the
    unstopped text (chosen to cross a token boundary where possible) as the
    stop string and check the output ends right before it.
    """
    prompt = "the world is good and the day"
    full, reason = _greedy(client, prompt, stream=stream)
    assert reason == "length" and len(full) > 12
    stop = full[6:11]
    text, reason = _greedy(client, prompt, stop=[stop, "never-there"], stream=stream)
    assert reason == "stop"
    assert stop not in text
    assert text == full[: full.index(stop)]


def test_stop_string_as_plain_string(client):
    full, _ = _greedy(client, "Hello the world")
    stop = full[3:5]
    text, reason = _greedy(client, "Hello the world", stop=stop)
    assert reason == "stop" and text == full[: full.index(stop)]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny.gguf"]
