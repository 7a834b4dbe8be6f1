"""Three measured behaviours of llama-cpp-python 0.3.36, pinned down.

1. ``create_completion(stream=True)`` is much slower per token than a bare
   ``Llama.generate`` loop, so the worker owns its loop. Pinned: the engine
   never calls ``create_completion`` and yields exactly what a bare greedy
   ``generate`` loop yields. (The speed ratio itself is measured by
   ``tests/bench/bench_generate_loop.py``.)
2. Prefix reuse after a generation that was stopped early or streamed
   (``workers/model/kv_cache.py``). Pinned: the failing sequence passes through the
   engine, with cached tokens reported.
3. ctypes releases the GIL during ``llama_decode``. Pinned: a pure-Python
   side thread keeps running during one decode call.
"""

from __future__ import annotations

import threading
import time

import llama_cpp
import pytest

from protocol.payloads import GenerationRequest, Sampling
from tests.null_sink import RecordingSink
from workers.model.llama_engine import LlamaEngine
from workers.model.llama_internals import EngineLlama


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LlamaEngine(str(tiny_model), n_ctx=512, n_threads=1)


def completion(prompt, ignore_eos=False, **kw):
    return GenerationRequest(
        "completion", prompt,
        sampling=Sampling(temperature=0.0, ignore_eos=ignore_eos), **kw)


# --- 1. the worker's own loop ----------------------------------------------------


def test_engine_never_uses_create_completion(engine, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("create_completion is the slow path")

    monkeypatch.setattr(engine.llama, "create_completion", forbidden)
    monkeypatch.setattr(engine.llama, "create_chat_completion", forbidden)
    sink = RecordingSink()
    result = engine.run(completion("Hello world", max_tokens=10, ignore_eos=True), sink)
    assert result.completion_tokens == 10 and result.finish_reason == "length"


def test_engine_output_equals_a_bare_generate_loop(engine, tiny_model):
    prompt = "the day is good"
    sink = RecordingSink()
    engine.run(completion(prompt, max_tokens=20, ignore_eos=True), sink)

    # EngineLlama: llama_cpp.Llama with this CPU's --repack auto (on AMX,
    # llama.cpp's repacked Q4 kernel crashes); its loop is the bare one.
    bare = EngineLlama(str(tiny_model), n_ctx=512, n_threads=1, verbose=False)
    tokens = bare.tokenize(prompt.encode(), special=True)
    out = []
    for token in bare.generate(tokens, temp=0.0, top_k=40, top_p=0.95, min_p=0.05):
        out.append(token)
        if len(out) == 20:
            break
    assert sink.text + "" == bare.detokenize(out).decode("utf-8", "replace")
    assert sum(n for _, n in sink.frames) <= 20


def test_cancel_is_checked_between_tokens(engine):
    sink = RecordingSink(cancel_after=3)
    result = engine.run(completion("Hello", max_tokens=200, ignore_eos=True), sink)
    assert result.finish_reason == "cancelled"
    assert len(sink.frames) == 3
    assert result.completion_tokens <= 4  # stopped within one token


# --- 2. prefix reuse after early stops and streaming ---------------------------------


def test_shared_prefix_after_early_stop_reuses_the_cache(engine):
    """The sequence that failed with ``llama_decode returned 1`` on 0.3.36."""
    base = "Hello world, this is a test of the model and"
    engine.run(completion(base, max_tokens=100, ignore_eos=True),
               RecordingSink(cancel_after=2))  # stopped early
    result = engine.run(completion(base + " more", max_tokens=5), RecordingSink())
    assert result.cached_tokens > 5
    sink = RecordingSink()
    engine.run(completion(base, max_tokens=30, ignore_eos=True), sink)  # streamed
    continuation = base + sink.text
    result = engine.run(completion(continuation, max_tokens=5, ignore_eos=True),
                        RecordingSink())
    assert result.cached_tokens > 5 and result.completion_tokens == 5


def test_many_mixed_requests_in_one_engine(engine):
    prompts = ["a", "the quick brown", "the quick brown fox", "Hello", "Hello world"]
    for i in range(200):
        prompt = prompts[i % len(prompts)] + " x" * (i % 7)
        sink = RecordingSink(cancel_after=(i % 4) or None)
        result = engine.run(completion(prompt, max_tokens=(i % 9) + 1,
                                       stop=["e"] if i % 3 == 0 else []), sink)
        assert result.finish_reason in ("stop", "length", "cancelled")


def test_odd_context_size_is_rounded_so_the_context_can_be_filled(tiny_model):
    """llama.cpp pads n_ctx to 256s while Llama's token record keeps the size
    asked for; filling the context must not run past either."""
    engine = LlamaEngine(str(tiny_model), n_ctx=300, n_threads=1)
    assert engine.n_ctx == 512 == len(engine.llama.input_ids)
    result = engine.run(completion("Hello", max_tokens=None, ignore_eos=True),
                        RecordingSink())
    assert result.finish_reason == "length"
    assert result.prompt_tokens + result.completion_tokens == engine.n_ctx
    # And again with a shared prefix after a full context.
    result = engine.run(completion("Hello world", max_tokens=8), RecordingSink())
    assert result.cached_tokens >= 1


# --- 3. the GIL is released during decode ---------------------------------------------


def test_side_thread_runs_during_one_decode_call(tiny_model):
    llama = EngineLlama(str(tiny_model), n_ctx=2048, n_batch=2048, n_ubatch=2048,
                        n_threads=1, verbose=False)
    tokens = llama.tokenize(b"Hello world " * 1000)[:2000]
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    token_array = (llama_cpp.llama_token * len(tokens))(*tokens)  # kept alive
    batch = llama_cpp.llama_batch_get_one(token_array, len(tokens))
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        before = counter[0]
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(llama._ctx.ctx, batch)  # one C call
        duration_s = time.perf_counter() - t0
        side_progress = counter[0] - before
    finally:
        stop.set()
        thread.join()
    assert rc == 0
    # If the GIL were held for the whole C call, the side thread could not
    # run a single iteration during it.
    assert side_progress > 1000, (duration_s, side_progress)
