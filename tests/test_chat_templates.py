"""Chat templates chosen as llama-server users choose them, and assistant
prefill, through real processes (issue 34, item 7).

``--chat-template NAME`` renders with llama.cpp's own built-in template,
``--chat-template-file FILE`` with a Jinja file; per request
``add_generation_prompt`` and ``continue_final_message`` (a last assistant
message is continued by default, as llama-server's ``--prefill-assistant``
does). A template that fails to render is a 400 naming it, from the
frontend's gate and from a worker alike.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.pool import Pool
from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

HI = [{"role": "user", "content": "hi"}]
LLAMA3_HI = ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n")

#: A Jinja file: chatml, and a refusal the template itself raises.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.content == 'boom' %}{{ raise_exception('no booms here') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ strftime_now('%Y') | length }}"
)


builtin_pool = pool_fixture(
    workers=1, worker_args=("--chat-template", "llama3"),
    frontend_env=(("LLAMAPOOL_CHAT_TEMPLATE", "llama3"),))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["gated", "worker-renders"])
def file_pool(request, template_file, pool_factory):
    with pool_factory(workers=1, frontend_tokenizes=request.param,
                      worker_args=("--chat-template-file", str(template_file)),
                      frontend_env=(("LLAMAPOOL_CHAT_TEMPLATE_FILE",
                                     str(template_file)),)) as p:
        yield p, request.param


def apply(pool: Pool, body: dict) -> httpx.Response:
    return httpx.post(pool.url + "/apply-template", json=body, timeout=30)


def chat(pool: Pool, body: dict) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions",
                      json={"max_tokens": 3, **body}, timeout=60)


def test_a_builtin_name_renders_as_llama_cpp_does(builtin_pool):
    shown = apply(builtin_pool, {"messages": HI}).json()["prompt"]
    assert shown == LLAMA3_HI
    out = openai.OpenAI(base_url=builtin_pool.url + "/v1", api_key="x",
                        max_retries=0).chat.completions.create(
        model="m", messages=HI, max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")
    no_prompt = apply(builtin_pool, {"messages": HI,
                                     "add_generation_prompt": False}).json()
    assert no_prompt["prompt"] == LLAMA3_HI.removesuffix(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_builtin_template_refuses_tools(builtin_pool):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    r = chat(builtin_pool, {"messages": HI, "tools": [tool]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


def test_prefill_continues_the_last_assistant_message(builtin_pool):
    """llama-server's default: a last assistant message is left open."""
    body = {"messages": [*HI, {"role": "assistant", "content": "Hel"}]}
    assert apply(builtin_pool, body).json()["prompt"] == LLAMA3_HI + "Hel"
    explicit = {**body, "continue_final_message": True,
                "add_generation_prompt": False}
    assert apply(builtin_pool, explicit).json()["prompt"] == LLAMA3_HI + "Hel"
    r = chat(builtin_pool, {**body, "continue_final_message": True})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Cannot set both add_generation_prompt and continue_final_message to true.")
    r = chat(builtin_pool, {"messages": HI, "continue_final_message": True,
                            "add_generation_prompt": False})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]
    # Continued or not, the job runs and counts the prompt as rendered.
    assert chat(builtin_pool, body).status_code == 200


def test_a_template_file_renders_with_llama_server_globals(file_pool):
    pool, gated = file_pool
    r = chat(pool, {"messages": HI})
    assert r.status_code == 200, r.text
    if gated:  # the frontend has the template (else /apply-template is 501)
        shown = apply(pool, {"messages": HI}).json()["prompt"]
        assert shown == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n4"


def test_a_template_that_fails_is_a_400_naming_it(file_pool, template_file):
    pool, _ = file_pool
    r = chat(pool, {"messages": [{"role": "user", "content": "boom"}]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert str(template_file) in message and "no booms here" in message
    pool.assert_whole()


def test_an_anthropic_prefill_is_continued(builtin_pool):
    """Anthropic continues a final assistant turn: the prompt ends in its
    text, and count_tokens counts what the message used."""
    client = anthropic.Anthropic(base_url=builtin_pool.url, api_key="x",
                                 max_retries=0, timeout=60)
    turns = [*HI, {"role": "assistant", "content": "Hel"}]
    out = client.messages.create(model="m", max_tokens=3, messages=turns)
    counted = client.messages.count_tokens(model="m", messages=turns)
    used = out.usage.input_tokens + out.usage.cache_read_input_tokens
    assert counted.input_tokens == used
    closed = client.messages.count_tokens(
        model="m", messages=[*turns, {"role": "user", "content": "hi"}])
    assert closed.input_tokens > counted.input_tokens
    shown = apply(builtin_pool, {"messages": turns}).json()["prompt"]
    assert shown.endswith("assistant<|end_header_id|>\n\nHel")
