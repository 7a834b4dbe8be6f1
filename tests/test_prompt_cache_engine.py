"""The prompt-state cache inside one engine (the real tiny model, in process):
a state that is damaged, from another model, or larger than the limit is
dropped, counted, and the prompt is prefilled cold; never a crash."""

from __future__ import annotations

import dataclasses

import llama_cpp
import pytest

from protocol.payloads import GenerationRequest, Sampling
from tests.null_sink import NullSink, RecordingSink
from workers.model.llama_engine import LlamaEngine
from workers.model.prompt_cache import PromptStateCache

A = "the cat sat on the mat " * 15
B = "a stitch in time saves nine " * 15
MORE = " and then the user said something else entirely"


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes(b ^ 0x5A for b in data[at:at + 64]) + data[at + 64:]



def run(engine: LlamaEngine, prompt: str):
    request = GenerationRequest(kind="completion", prompt=prompt, max_tokens=12,
                                sampling=Sampling(temperature=0.0, ignore_eos=True))
    return engine.run(request, NullSink())


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=16)


@pytest.fixture(scope="module")
def cold_text(tiny_model):
    """A + MORE prefilled from an empty KV cache, by an engine with no cache."""
    cold = LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=0)
    result = run(cold, A + MORE)
    assert result.cached_tokens == 0
    return result.tail_text


def _saved_a(engine: LlamaEngine):
    """Run A then B, so that A's state is saved; return the key and state
    that A + MORE will be restored from (the engine is shared by the tests:
    an earlier one may have left a state of A's conversation too)."""
    cache = engine.reuse.cache
    run(engine, A)
    run(engine, B)
    key, shared = cache.longest_prefix(
        engine.prompts.llama.tokenize((A + MORE).encode()))
    assert key is not None and shared > 100
    return key, cache._states[key]


@pytest.mark.parametrize("damage", [
    lambda s: dataclasses.replace(s, data=s.data[: len(s.data) // 2]),
    # 64 bytes flipped among the KV values: llama.cpp alone would load it.
    lambda s: dataclasses.replace(s, data=flipped(s.data, len(s.data) // 2)),
    lambda s: dataclasses.replace(s, model_id="another-model.gguf:1:1"),
], ids=["truncated", "corrupted", "other-model"])
def test_an_unusable_state_is_dropped_and_the_prompt_runs_cold(
        engine, cold_text, damage):
    cache = engine.reuse.cache
    key, state = _saved_a(engine)
    cache._states[key] = damage(state)
    dropped = cache.dropped
    result = run(engine, A + MORE)
    assert result.cached_tokens <= 1
    assert result.tail_text == cold_text
    assert cache.dropped == dropped + 1
    # And the next turn of the same conversation uses the live sequence.
    assert run(engine, A + MORE + " yes").cached_tokens > 100


def test_a_restored_state_generates_what_a_cold_prefill_does(engine, cold_text):
    _saved_a(engine)
    hits = engine.reuse.cache.hits
    result = run(engine, A + MORE)
    assert result.cached_tokens > 100
    assert engine.reuse.cache.hits == hits + 1
    assert result.tail_text == cold_text


def test_a_state_larger_than_the_limit_is_not_kept(engine):
    full = engine.reuse.cache
    # A limit below one state of the tiny model (~0.1 MiB at 200 tokens).
    engine.reuse.cache = small = PromptStateCache(4096, full.model_id)
    try:
        run(engine, A)
        run(engine, B)
        assert small.dropped >= 1
        assert len(small) == 0 and small.bytes_used == 0
        assert run(engine, A + MORE).cached_tokens <= 1
    finally:
        engine.reuse.cache = full


def test_a_state_already_cached_is_not_saved_again(tiny_model, monkeypatch):
    """The same prompt sent again (a retry, "regenerate", a benchmark) found
    its last reply in the KV cache and saved that sequence before trimming
    it, every time, although an identical state was already cached: a copy
    of the whole KV state in each request's time to first token (6.5 ms for
    128 tokens of Gemma, ``make bench-ttft-hops --tokens 128``)."""
    engine = LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=16)
    request = GenerationRequest(kind="completion", prompt=A, max_tokens=48,
                                sampling=Sampling(temperature=0.0, ignore_eos=True))
    saves = []
    real_get_data = llama_cpp.llama_state_seq_get_data

    def counting_get_data(*args):
        saves.append(args[-1])
        return real_get_data(*args)

    monkeypatch.setattr(llama_cpp, "llama_state_seq_get_data", counting_get_data)

    def answer() -> tuple[str, int]:
        sink = RecordingSink()
        result = engine.run(request, sink)
        return sink.text + result.tail_text, result.cached_tokens

    texts = [answer()[0] for _ in range(4)]
    # The second run saves the first one's prompt and reply; after that the
    # same sequence is in the cache already.
    assert len(saves) == 1
    assert len(engine.reuse.cache) == 1
    assert len(set(texts)) == 1 and len(texts[0]) > 20
    # A different prompt still saves what it displaces (it is held already,
    # so nothing new), and the next repeat of A restores rather than prefills.
    run(engine, B)
    assert len(saves) == 1
    text, cached = answer()
    assert cached > 100
    assert text == texts[0]



def test_a_finished_sequence_is_saved_between_jobs_not_in_the_next_ttft(
        tiny_model, monkeypatch):
    """The worker gives the engine its idle time after a job: the sequence
    just finished is saved then, so the next job, which moves away from it,
    starts without copying the KV state first (5.6 ms for 140 tokens of
    Gemma in the new conversation's time to first token)."""
    engine = LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=16)
    saves: list[str] = []
    phase = ["job"]
    real_get_data = llama_cpp.llama_state_seq_get_data

    def counting_get_data(*args):
        saves.append(phase[0])
        return real_get_data(*args)

    monkeypatch.setattr(llama_cpp, "llama_state_seq_get_data", counting_get_data)

    def job(prompt: str):
        phase[0] = "job"
        return run(engine, prompt)

    def idle() -> bool:
        phase[0] = "idle"
        return engine.idle()

    job(A)
    assert idle() is True
    assert len(engine.reuse.cache) == 1 and saves == ["idle"]
    assert idle() is False  # nothing new to keep
    job(B)  # moves away from A: already saved, so no copy in this job
    assert saves == ["idle"]
    assert idle() is True
    assert saves == ["idle", "idle"]
    # A's conversation goes on from the state saved while idle.
    assert job(A + MORE).cached_tokens > 100
    assert "job" not in saves


def test_a_short_sequence_or_a_disabled_cache_saves_nothing_between_jobs(tiny_model):
    off = LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=0)
    run(off, A)
    assert off.idle() is False and len(off.reuse.cache) == 0
    on = LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=16)
    run(on, "hi")  # shorter than one fingerprint block
    assert on.idle() is False and len(on.reuse.cache) == 0
