"""llama.cpp's logit-bias sampler in the worker's chain (``workers.model.native_bias``).

In process, on the tiny GGUF: the bias and the bans that ``RequestLogits``
hands to llama.cpp change sampling as the Python processors did, the
processors still see the raw logits first, and a chain made after the job
carries no bias.
"""

from __future__ import annotations

import math

import llama_cpp
import numpy as np
import pytest

from protocol.payloads import GenerationRequest, LogitBias, Sampling
from tests.null_sink import NullSink
from workers.model.llama_engine import LlamaEngine
from workers.model.llama_internals import EngineLlama
from workers.model.logits import RequestLogits
from workers.model.native_bias import LogitBiasLlama

GREEDY = {"temp": 0.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def llama(tiny_model):
    # EngineLlama is a LogitBiasLlama with this CPU's --repack auto (on AMX,
    # llama.cpp's repacked Q4 kernel crashes).
    return EngineLlama(str(tiny_model), n_ctx=256, n_threads=1, verbose=False)


def first_tokens(llama, n: int, bias: dict[int, float], processors=None) -> list[int]:
    llama.logit_bias = bias
    try:
        out = []
        for token in llama.generate(llama.tokenize(b"Hello there"), reset=True,
                                    logits_processor=processors, **GREEDY):
            out.append(token)
            if len(out) == n:
                break
        return out
    finally:
        llama.logit_bias = {}


def test_a_large_bias_forces_its_token(llama):
    plain = first_tokens(llama, 4, {})
    forced = next(t for t in range(10, llama.n_vocab()) if t not in plain)
    assert first_tokens(llama, 4, {forced: 100.0}) == [forced] * 4


def test_a_ban_removes_the_greedy_choice(llama):
    greedy = first_tokens(llama, 1, {})[0]
    assert first_tokens(llama, 1, {greedy: -math.inf})[0] != greedy
    # The next chain, made with the bias cleared, has no ban.
    assert first_tokens(llama, 1, {})[0] == greedy


def test_python_processors_still_see_the_raw_logits_first(llama):
    greedy = first_tokens(llama, 1, {})[0]
    seen = []

    def record(input_ids, scores):
        seen.append(float(scores[greedy]))
        return scores

    processors = llama_cpp.LogitsProcessorList([record])
    first_tokens(llama, 1, {}, processors)
    banned = first_tokens(llama, 1, {greedy: -math.inf}, processors)
    # The processor saw the same logit both times (the ban comes after it),
    # and the ban still held.
    assert seen[0] == seen[1] and np.isfinite(seen[1])
    assert banned[0] != greedy


def request(**fields) -> GenerationRequest:
    sampling = fields.pop("sampling", {})
    return GenerationRequest(kind="completion", prompt="Hi",
                             sampling=Sampling(**sampling), **fields)


def logits_for(req: GenerationRequest, llama) -> RequestLogits:
    return RequestLogits(req, vocab=llama._model.vocab, n_vocab=llama.n_vocab(),
                         eog_ids=[1, 2], tokenize=lambda text: [7])


def test_bias_and_ignore_eos_go_to_llama_cpp(llama):
    logits = logits_for(request(sampling={
        "ignore_eos": True, "logit_bias": [LogitBias(token=5, bias=2.5)]}), llama)
    assert logits.native_bias == {5: 2.5, 1: -math.inf, 2: -math.inf}
    assert logits.processor_list() is None


def test_log_probabilities_stay_a_processor_beside_the_native_bias(llama):
    logits = logits_for(request(logprobs=2, sampling={"ignore_eos": True}), llama)
    assert logits.native_bias == {1: -math.inf, 2: -math.inf}
    assert logits.processor_list() == [logits.logprobs]


@pytest.mark.parametrize("fields", [
    # The grammar's dead-end check must see every ban.
    {"grammar": 'root ::= "a"', "sampling": {"ignore_eos": True}},
    # Bans of the client's own could ban every token: the never-empty guard
    # runs after them, in Python.
    {"sampling": {"logit_bias": [LogitBias(token=5, never=True)]}},
])
def test_what_must_see_the_bans_keeps_them_in_python(llama, fields):
    logits = logits_for(request(**fields), llama)
    try:
        assert logits.native_bias == {}
        assert len(logits.processor_list()) >= 2
    finally:
        logits.close()


def test_the_engine_hands_ignore_eos_to_llama_cpp(tiny_model, monkeypatch):
    engine = LlamaEngine(str(tiny_model), n_ctx=256, n_threads=1)
    assert engine._eog_ids, "the test model has end tokens to ban"
    chains = []
    make_chain = LogitBiasLlama._init_sampler

    def spy(self, *args, **kwargs):
        chains.append((dict(self.logit_bias), kwargs.get("logits_processor")))
        return make_chain(self, *args, **kwargs)

    monkeypatch.setattr(LogitBiasLlama, "_init_sampler", spy)
    result = engine.run(GenerationRequest("completion", "Hello", max_tokens=3,
                                          sampling=Sampling(ignore_eos=True)),
                        NullSink())
    assert result.completion_tokens == 3
    assert chains == [(dict.fromkeys(engine._eog_ids, -math.inf), None)]
    assert engine.llama.logit_bias == {}
