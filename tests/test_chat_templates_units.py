"""Chat template choice and continuation, in process (issue 34, item 7):
the settings' one string, a built-in name, a reasoning template's
continued message, and a failing template's 400 text."""

from __future__ import annotations

import pytest

from llamapool.test_model import REASONING_CHAT_TEMPLATE, write_test_model
from protocol.chat_choice import ChatChoiceError, chat_choice
from protocol.payloads import ChatMessage
from workers.model.chat_templates import ChatTemplateError, builtin_names
from workers.model.prompting import PromptBuilder, PromptError


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "reasoning.gguf"
    write_test_model(path, chat_template=REASONING_CHAT_TEMPLATE)
    return str(path)


def test_one_choice_of_three():
    assert chat_choice(None, "", "") is None
    assert chat_choice("gemma", "", "") == "gemma"
    assert chat_choice(None, "llama3", "") == "chat-template:llama3"
    assert chat_choice(None, "", "/t.jinja") == "file:/t.jinja"
    with pytest.raises(ChatChoiceError):
        chat_choice("gemma", "llama3", "")


def test_builtin_names_are_llama_cpps():
    names = builtin_names()
    assert {"chatml", "llama3", "gemma", "mistral-v7", "deepseek3",
            "command-r", "phi4"} <= set(names)


def test_a_continued_reasoning_message_closes_its_reasoning(reasoning_model):
    builder = PromptBuilder.vocab_only(reasoning_model, None)
    turns = [ChatMessage("user", "hi"), ChatMessage("assistant", "Hel", "plan")]
    prompt = builder.render_chat(turns, continue_final=True,
                                 add_generation_prompt=False).prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\nplan\n</think>\n\nHel")
    closed = builder.render_chat(turns).prompt
    assert closed.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_a_bad_template_file_stops_the_start(tmp_path, reasoning_model):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="bad.jinja"):
        PromptBuilder.vocab_only(reasoning_model, f"file:{bad}")


def test_a_raising_template_is_a_prompt_error_naming_it(tmp_path, reasoning_model):
    path = tmp_path / "t.jinja"
    path.write_text("{{ raise_exception('nope') }}")
    builder = PromptBuilder.vocab_only(reasoning_model, f"file:{path}")
    with pytest.raises(PromptError, match=r"t\.jinja failed to render: nope"):
        builder.render_chat([ChatMessage("user", "hi")])
