"""The batched decode loop in process: a ``BatchRunner`` on the tiny model,
its two slots fed ``ActiveJob``s directly (no broker, no sockets).

What it pins down: greedy text per slot equals the one-slot engine's for
the same request (prompts longer than a step included, so prefill runs in
chunks beside the other slot's decoding); a slot that gets no credit ends
as stalled without holding the other back; a cancel ends only its own
slot; and what ``--slots`` refuses at start.
"""

from __future__ import annotations

import threading
import time

import pytest

from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import (
    COMPLETION,
    EMBEDDING,
    EmbeddingInput,
    GenerationRequest,
    LogitBias,
    Sampling,
)
from protocol.settings import ConfigError
from workers.model.active_job import ActiveJob, Outgoing
from workers.model.batch_runner import BatchRunner
from workers.model.batched_engine import BatchedEngine
from workers.model.llama_engine import LlamaEngine
from workers.model.settings import WorkerSettings

#: Small steps, so that a prompt of a few hundred tokens takes several.
N_BATCH = 64
N_CTX = 512


def greedy(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(kind=COMPLETION, prompt_tokens=prompt,
                             max_tokens=max_tokens,
                             sampling=Sampling(temperature=0.0, ignore_eos=True))


class Slots:
    """A running ``BatchRunner`` of two slots and what each slot sent."""

    def __init__(self, model, n_slots: int = 2, **settings) -> None:
        self.settings = WorkerSettings(broker_endpoint="ipc:///nobody", n_slots=n_slots,
                                       n_ctx=N_CTX, n_threads="1", **settings)
        self.runner = BatchRunner(self.settings, lambda: BatchedEngine(
            str(model), n_slots=n_slots, n_ctx=N_CTX, n_threads=1, n_batch=N_BATCH))
        self.sent: dict[str, list[messages.Message]] = {}
        self.reports: list[messages.CacheReport] = []
        self.ended_at: dict[str, float] = {}
        self._changed = threading.Condition()
        #: Jobs whose client reads everything: credit back for each frame.
        self.reading: set[str] = set()
        for port in self.runner.ports:
            port.send = self._got
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.runner.run, args=(self.stop,))
        self.thread.start()

    def _got(self, out: Outgoing) -> None:
        msg, job = out.message, out.job
        if job is None:  # a slot's CACHE_REPORT
            with self._changed:
                self.reports.append(msg)
            return
        with self._changed:
            self.sent.setdefault(job.job_id, []).append(msg)
            if isinstance(msg, messages.TERMINAL):
                self.ended_at[job.job_id] = time.monotonic()
            self._changed.notify_all()
        if isinstance(msg, messages.Token) and job.job_id in self.reading:
            job.add_credit(1)

    def submit(self, seq: int, job_id: str, request: GenerationRequest,
               reading: bool = True) -> ActiveJob:
        if reading:
            self.reading.add(job_id)
        holder: list[ActiveJob] = []
        job = ActiveJob(messages.Submit(job_id, request),
                        lambda m: self._got(Outgoing(holder[0], m)), self.settings)
        holder.append(job)
        self.runner.submit_to(seq, job)
        return job

    def terminal(self, job_id: str, timeout_s: float = 30.0) -> messages.Message:
        with self._changed:
            assert self._changed.wait_for(lambda: job_id in self.ended_at,
                                          timeout_s), f"{job_id} did not end"
            return self.sent[job_id][-1]

    def text(self, job_id: str) -> str:
        frames = self.sent[job_id]
        return "".join(f.text for f in frames if isinstance(f, messages.Token)) + (
            frames[-1].text)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def slots(tiny_model):
    s = Slots(tiny_model)
    yield s
    s.close()


def one_slot_text(model, request: GenerationRequest) -> str:
    """What the one-slot engine generates for ``request``."""
    engine = LlamaEngine(str(model), n_ctx=N_CTX, n_threads=1, n_batch=N_BATCH,
                         cache_ram_mib=0)
    frames: list[messages.Message] = []
    settings = WorkerSettings(broker_endpoint="ipc:///nobody")
    job = ActiveJob(messages.Submit("solo", request), frames.append, settings)
    result = engine.run(request, job)
    return "".join(f.text for f in frames) + result.tail_text


def test_greedy_text_of_two_slots_at_once_equals_the_one_slot_engine(
        slots, tiny_model):
    short = greedy([1, 40, 41, 42], 60)
    # Longer than four steps: its prefill runs in chunks while the short
    # job decodes beside it.
    long = greedy([1, *range(100, 100 + 5 * N_BATCH)], 30)
    slots.submit(0, "short", short)
    slots.submit(1, "long", long)
    for job_id, request in (("short", short), ("long", long)):
        final = slots.terminal(job_id)
        assert isinstance(final, messages.Final), final
        assert final.finish_reason == messages.FinishReason.LENGTH
        assert final.usage.completion_tokens == request.max_tokens
        assert final.usage.prompt_tokens == len(request.prompt_tokens)
        text = slots.text(job_id)
        assert text and text == one_slot_text(tiny_model, request)


class UbatchCounter:
    """How many ubatches llama.cpp ran for each ``llama_decode`` call, and
    the sequence ids each call's batch held: llama.cpp's graph-evaluation
    callback sees the logits tensor (``result_output``) once per ubatch.
    Installed through the default context params, so the engine under test
    builds its context as it always does, plus the callback."""

    def __init__(self, monkeypatch) -> None:
        import ctypes
        import os

        import llama_cpp
        from llama_cpp import llama_cpp as bindings

        ggml = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib",
                                        "libggml-base.so"))
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        self._ubatches = 0
        #: One (sequence ids in batch order, ubatches) per decode call.
        self.calls: list[tuple[list[int], int]] = []

        def observe(tensor, ask, _user_data):
            if ggml.ggml_get_name(tensor) != b"result_output":
                return False
            if not ask:
                self._ubatches += 1
            return True

        self._observe = bindings.ggml_backend_sched_eval_callback(observe)
        defaults = bindings.llama_context_default_params

        def with_callback():
            params = defaults()
            params.cb_eval = self._observe
            return params

        real_decode = llama_cpp.llama_decode

        def decode(ctx, batch):
            self._ubatches = 0
            rc = real_decode(ctx, batch)
            seqs = [batch.seq_id[i][0] for i in range(batch.n_tokens)]
            self.calls.append((seqs, self._ubatches))
            return rc

        monkeypatch.setattr(bindings, "llama_context_default_params", with_callback)
        monkeypatch.setattr(llama_cpp, "llama_decode", decode)


def test_a_step_is_one_ubatch_whichever_slots_take_part(tiny_model, monkeypatch):
    # Slot 2 starts first and slot 1 stays idle: its batches list slot 2
    # before slot 0, with a gap between, which a per-sequence cache would
    # decode as two ubatches.
    counter = UbatchCounter(monkeypatch)
    s = Slots(tiny_model, n_slots=3)
    try:
        s.submit(2, "first", greedy([1, 40, 41], 40))
        with s._changed:
            assert s._changed.wait_for(lambda: s.sent.get("first"), 30)
        s.submit(0, "second", greedy([1, 50, 51], 40))
        for job_id in ("first", "second"):
            assert isinstance(s.terminal(job_id), messages.Final)
    finally:
        s.close()
    shared = [(seqs, n) for seqs, n in counter.calls if len(set(seqs)) > 1]
    assert shared, "no step carried both slots"
    assert [n for _, n in shared] == [1] * len(shared), shared


def test_each_slot_is_held_to_its_own_context_in_the_shared_cache(slots):
    # The cache is unified (K x --ctx cells), so llama.cpp would let one
    # sequence grow past its share: the token budget must not.
    def tokens(n: int) -> list[int]:
        return [1, *(100 + i % 300 for i in range(n - 1))]

    slots.submit(0, "too-long", greedy(tokens(N_CTX), 4))
    refused = slots.terminal("too-long")
    assert slots.runner.engine.n_ctx == N_CTX
    assert isinstance(refused, messages.Error), refused
    assert refused.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert refused.n_ctx == N_CTX
    prompt = tokens(N_CTX - 10)  # room for 10 tokens
    slots.submit(0, "fills", greedy(prompt, 100))
    slots.submit(1, "beside", greedy([1, 40, 41], 30))
    filled = slots.terminal("fills")
    assert isinstance(filled, messages.Final), filled
    assert filled.usage.completion_tokens == N_CTX - len(prompt)
    assert filled.truncated
    beside = slots.terminal("beside")
    assert isinstance(beside, messages.Final) and beside.usage.completion_tokens == 30


def test_a_stalled_slot_does_not_hold_back_the_other(tiny_model):
    s = Slots(tiny_model, credit_window_frames=2, stall_timeout_s=1.0)
    try:
        s.submit(0, "stalled", greedy([1, 40, 41], 200), reading=False)
        s.submit(1, "reader", greedy([1, 50, 51], 200))
        done = s.terminal("reader")
        assert isinstance(done, messages.Final), done
        assert done.usage.completion_tokens == 200
        stalled = s.terminal("stalled")
        assert isinstance(stalled, messages.Error)
        assert stalled.code == ErrorCode.CLIENT_STALLED
        assert s.ended_at["reader"] < s.ended_at["stalled"]
        # It sent its window's frames, and no more.
        assert sum(isinstance(f, messages.Token) for f in s.sent["stalled"]) <= 2
    finally:
        s.close()


def test_a_cancel_ends_only_its_own_slot(tiny_model):
    s = Slots(tiny_model, credit_window_frames=2)
    try:
        held = s.submit(0, "held", greedy([1, 40, 41], 200), reading=False)
        other = s.submit(1, "other", greedy([1, 50, 51], 150), reading=False)
        # Both paused for credit; one is cancelled, the other read on.
        with s._changed:
            assert s._changed.wait_for(
                lambda: all(len(s.sent.get(j, [])) >= 2 for j in ("held", "other")),
                30)
        held.cancel()
        cancelled = s.terminal("held")
        assert isinstance(cancelled, messages.Final)
        assert cancelled.finish_reason == messages.FinishReason.CANCELLED
        s.reading.add("other")
        other.add_credit(1000)
        final = s.terminal("other")
        assert isinstance(final, messages.Final)
        assert final.usage.completion_tokens == 150
    finally:
        s.close()


def test_an_embedding_job_runs_beside_a_generating_slot(slots):
    slots.submit(0, "gen", greedy([1, 40, 41], 80))
    slots.submit(1, "emb", GenerationRequest(
        kind=EMBEDDING, inputs=[EmbeddingInput(tokens=[1, 2, 3]),
                                EmbeddingInput(tokens=[1, 5])]))
    done = slots.terminal("emb")
    assert isinstance(done, messages.Final), done
    vectors = [f for f in slots.sent["emb"] if isinstance(f, messages.Token)]
    assert len(vectors) == 2 and all(f.embedding for f in vectors)
    gen = slots.terminal("gen")
    assert isinstance(gen, messages.Final)
    assert gen.usage.completion_tokens == 80


def constrained(prompt: list[int], grammar: str, banned: int) -> GenerationRequest:
    """Greedy, with a grammar, a ban, a bias and two top log-probabilities:
    every logits processor a request can ask for at once."""
    return GenerationRequest(
        kind=COMPLETION, prompt_tokens=prompt, max_tokens=12, logprobs=2,
        grammar=grammar,
        sampling=Sampling(temperature=0.0, logit_bias=[
            LogitBias(token=banned, never=True), LogitBias(token=banned + 1,
                                                           bias=3.0)]))


def one_slot_frames(model, request: GenerationRequest):
    engine = LlamaEngine(str(model), n_ctx=N_CTX, n_threads=1, n_batch=N_BATCH,
                         cache_ram_mib=0)
    frames: list[messages.Message] = []
    settings = WorkerSettings(broker_endpoint="ipc:///nobody")
    job = ActiveJob(messages.Submit("solo", request), frames.append, settings)
    result = engine.run(request, job)
    text = "".join(f.text for f in frames) + result.tail_text
    logprobs = [e for f in frames for e in f.logprobs] + result.tail_logprobs
    return text, logprobs


def test_grammar_bias_and_logprobs_per_slot_equal_the_one_slot_engine(
        slots, tiny_model):
    # Two different grammars decoded in one batch: each slot's mask and
    # parse state are its own.
    digits = constrained([1, 40, 41], 'root ::= [0-9]+ " " [a-z]+', 45)
    words = constrained([1, 50, 51, 52], 'root ::= ("yes" | "no") ","', 60)
    slots.submit(0, "digits", digits)
    slots.submit(1, "words", words)
    for job_id, request in (("digits", digits), ("words", words)):
        final = slots.terminal(job_id)
        assert isinstance(final, messages.Final), final
        frames = slots.sent[job_id]
        logprobs = [e for f in frames[:-1] for e in f.logprobs] + final.logprobs
        want_text, want_logprobs = one_slot_frames(tiny_model, request)
        assert slots.text(job_id) == want_text
        assert [e.id for e in logprobs] == [e.id for e in want_logprobs]
        assert len(logprobs) == final.usage.completion_tokens
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert len(got.top) == 2
            assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
    assert slots.text("words").rstrip(",") in ("yes", "no")


@pytest.mark.parametrize("extra, says", [
    ({"n_threads": "auto"}, "--threads auto"),
    ({"engine": "synthetic"}, "llama.cpp engine"),
    ({"n_slots": 65}, "from 1 to 64"),
])
def test_what_several_slots_refuse_at_start(extra, says):
    fields = {"broker_endpoint": "ipc:///nobody", "n_slots": 2, **extra}
    with pytest.raises(ConfigError, match=says):
        WorkerSettings(**fields)
