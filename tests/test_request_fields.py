"""What each endpoint accepts is what its readers read (frontend.request_fields).

No list of "implemented" fields exists to drift from the code: a field no
reader reads gets a 400 naming it. These pin the fields each parser reads
(so a reader that stopped reading one would be caught), the policy for what
is accepted unread, and that a field overruled by another is still read.
"""

from __future__ import annotations

import pytest

from frontend import native_schema, openai_schema
from frontend.embeddings import EmbeddingRequest
from frontend.errors import BadRequest
from frontend.request_fields import RequestFields

SAMPLERS = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "repeat_penalty": 1.1, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "seed": 3, "ignore_eos": False,
            "logit_bias": {"5": 1.0}, "n": 1}
COMMON = {**SAMPLERS, "model": "m", "stream": False, "stop": ["x"],
          "grammar": "", "timings_per_token": False, "n_predict": 4,
          "max_tokens": 4, "n_probs": 0}


def _accepted(parse, body):
    try:
        parse(body)
    except BadRequest as exc:
        pytest.fail(f"{sorted(body)}: {exc}")


@pytest.mark.parametrize("parse, body", [
    (openai_schema.parse_completion,
     {**COMMON, "prompt": "hi", "logprobs": 2, "echo": False,
      "stream_options": {"include_usage": False}, "max_completion_tokens": 4,
      "json_schema": None, "response_format": {"type": "text"}}),
    (openai_schema.parse_chat,
     {**COMMON, "messages": [{"role": "user", "content": "hi"}],
      "logprobs": True, "top_logprobs": 2, "tools": [], "tool_choice": "auto",
      "functions": None, "function_call": None, "max_completion_tokens": 4,
      "stream_options": {"include_usage": True}}),
    (native_schema.parse_completion,
     {**COMMON, "prompt": "hi", "cache_prompt": False, "id_slot": -1,
      "return_tokens": True, "n_probs": 2}),
    (lambda body: native_schema.parse_completion(body, infill=True),
     {**COMMON, "prompt": "", "input_prefix": "a", "input_suffix": "b",
      "input_extra": []}),
    (native_schema.parse_tokenize,
     {"content": "hi", "add_special": True, "parse_special": False,
      "with_pieces": True, "model": "m"}),
    (native_schema.parse_detokenize, {"tokens": [1, 2], "model": "m"}),
    (lambda body: EmbeddingRequest(body, native_route=False),
     {"input": "a", "content": "b", "model": "m", "encoding_format": "float",
      "dimensions": 8, "embd_normalize": 2, "user": "u"}),
])
def test_every_field_an_endpoint_implements_is_accepted(parse, body):
    _accepted(parse, body)


@pytest.mark.parametrize("parse, base", [
    (openai_schema.parse_completion, {"prompt": "hi"}),
    (openai_schema.parse_chat, {"messages": [{"role": "user", "content": "hi"}]}),
    (native_schema.parse_completion, {"prompt": "hi"}),
    (native_schema.parse_tokenize, {"content": "hi"}),
    (native_schema.parse_detokenize, {"tokens": []}),
    (lambda body: EmbeddingRequest(body, native_route=False), {"input": "a"}),
])
def test_a_field_no_reader_reads_is_refused_by_name(parse, base):
    with pytest.raises(BadRequest) as caught:
        parse({**base, "frobnicate": 1})
    assert caught.value.param == "frobnicate"
    assert "not supported" in str(caught.value)


@pytest.mark.parametrize("parse, base, name", [
    # OpenAI's names are not llama.cpp's: the native parser reads neither.
    (native_schema.parse_completion, {"prompt": "hi"}, "max_completion_tokens"),
    (native_schema.parse_completion, {"prompt": "hi"}, "stream_options"),
    # The infill fields are read only by /infill.
    (native_schema.parse_completion, {"prompt": "hi"}, "input_prefix"),
    # Embeddings have no samplers, and no no-op values either.
    (lambda body: EmbeddingRequest(body, native_route=False), {"input": "a"},
     "temperature"),
    (lambda body: EmbeddingRequest(body, native_route=False), {"input": "a"},
     "typical_p"),
])
def test_a_field_another_endpoint_reads_is_refused_here(parse, base, name):
    with pytest.raises(BadRequest) as caught:
        parse({**base, name: 1 if name != "stream_options" else {}})
    assert caught.value.param == name


def test_an_overruled_field_is_still_read():
    """n_predict wins over max_tokens, logprobs over n_probs: the losing
    field was understood, not ignored."""
    parsed = openai_schema.parse_completion(
        {"prompt": "hi", "n_predict": 3, "max_tokens": 9, "logprobs": 1,
         "n_probs": 5})
    assert parsed.generation.max_tokens == 3
    assert parsed.generation.logprobs == 1


def test_the_policy_accepts_no_op_values_and_labels_unread():
    body = {"prompt": "hi", "typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5,
            "user": "someone", "metadata": {"a": 1}}
    openai_schema.parse_completion(body)
    with pytest.raises(BadRequest) as caught:
        openai_schema.parse_completion({"prompt": "hi", "typical_p": 0.5})
    assert caught.value.param == "typical_p"
    assert "only its default" in str(caught.value)


def test_the_infill_step_reads_exactly_the_fields_its_parser_defers():
    fields = RequestFields({"input_prefix": "a", "input_suffix": "b",
                            "input_extra": [{"text": "c"}]})
    native_schema.parse_infill_input(fields)
    assert fields.read == frozenset(native_schema.INFILL_INPUT_FIELDS)


def test_a_body_that_is_not_an_object_is_refused():
    for parse in (openai_schema.parse_completion, native_schema.parse_tokenize):
        with pytest.raises(BadRequest, match="JSON object"):
            parse(["prompt"])


def test_the_native_model_field_is_read_not_ignored():
    """``model`` was in the native endpoints' list and read by nobody: a
    number passed, and the name never reached the answer."""
    assert native_schema.parse_completion({"prompt": "", "model": "m"}).model == "m"
    with pytest.raises(BadRequest) as caught:
        native_schema.parse_completion({"prompt": "", "model": 5})
    assert caught.value.param == "model"
