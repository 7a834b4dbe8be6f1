"""A tool format's markers that are control tokens of the vocabulary
(Mistral's ``[TOOL_CALLS]``) are written as text in an answer to a request
with tools, or the frontend's parser would never see a call.

Before, the detokeniser wrote no control token's text: a real Mistral's
``[TOOL_CALLS]`` token came out as nothing, and its calls as plain text.
In process, on a tiny GGUF whose vocabulary has the markers as control
tokens (``make-test-model --tool-format mistral-v11`` makes one).
"""

from __future__ import annotations

import json

import pytest

from llamapool.test_model import (
    MISTRAL_V11_TOOLS_CHAT_TEMPLATE,
    TOOL_FORMAT_CONTROL_PIECES,
    write_test_model,
)
from protocol import tool_formats
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.llama_internals import vocab_handle
from workers.model.prompting import PromptBuilder


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    path = tmp_path_factory.mktemp("preserved") / "mistral.gguf"
    write_test_model(path, chat_template=MISTRAL_V11_TOOLS_CHAT_TEMPLATE,
                     control_pieces=TOOL_FORMAT_CONTROL_PIECES["mistral-v11"])
    return PromptBuilder.vocab_only(str(path), None)


def test_the_markers_are_control_tokens_kept_as_text(builder):
    assert builder.tool_format is tool_formats.MISTRAL_V11
    preserved = builder.preserved_tokens()
    assert len(preserved) == 3
    [marker] = builder.llama.tokenize(b"[TOOL_CALLS]", add_bos=False, special=True)
    plain = IncrementalDetokenizer(vocab_handle(builder.llama))
    kept = IncrementalDetokenizer(vocab_handle(builder.llama), preserved=preserved)
    assert plain.push(marker) == ""  # a control token: no text by default
    assert kept.push(marker) == "[TOOL_CALLS]"


def test_an_answer_written_with_the_control_tokens_parses_as_a_call(builder):
    text = '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}'
    tokens = builder.llama.tokenize(text.encode(), add_bos=False, special=True)
    detok = IncrementalDetokenizer(vocab_handle(builder.llama),
                                   preserved=builder.preserved_tokens())
    written = "".join(detok.push(t) for t in tokens)
    # The markers' text is there (an SPM vocabulary adds a word's space).
    assert written.replace(" ", "") == text.replace(" ", "")
    content, calls = tool_formats.MISTRAL_V11.split(written, json.loads)
    assert [(name, json.loads(args)) for name, args in calls] == [
        ("weather", {"city": "Paris"})] and content == ""
