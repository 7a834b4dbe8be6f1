"""Embeddings on the default model: what the design choice costs.

``python -m tests.bench.bench_embeddings [--model PATH] [--repeats N]``
(``make bench-embeddings``) measures, for Gemma 3 270M by default:

1. Through a real pool (broker, one worker with one thread, gunicorn):
   latency of one input of 10, 100 and 500 tokens; a batch of 32 short
   inputs in one request; the first request (which makes the worker's
   embedding context); and the worker's RSS before and after that.
2. In one process, the alternative this pool did not take, embedding in the
   generation context with ``llama_set_embeddings`` toggled on: the
   per-input time (per-token outputs, mean-pooled in numpy, as the
   generation context's pooling is the model's "none"), and what it would
   cost the next chat turn, whose cached prefix the embedding overwrote
   (the prefill of a 1000-token conversation).

CPU time is reported next to wall time (the worker's, from /proc; in
process, ``time.process_time``): on a shared 2-core machine wall times swing
several-fold with the load, CPU times much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
from llama_cpp import _internals

from tests.bench.harness import cpu_seconds, md_table
from tests.pool import Pool
from workers.model.embedding import Embedder, normalize
from workers.model.prompting import PromptBuilder

WORD = "lorem "


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def text_of(vocab: llama_cpp.Llama, n_tokens: int) -> str:
    """A text that tokenises (with BOS) to exactly ``n_tokens``."""
    words = n_tokens
    while True:
        text = (WORD * words).strip()
        got = len(vocab.tokenize(text.encode(), add_bos=True, special=True))
        if got == n_tokens:
            return text
        words += n_tokens - got
        if words <= 0:
            raise RuntimeError("cannot hit the token count")


def post_ms(url: str, body: dict, worker_pid: int) -> tuple[float, float, dict]:
    """Wall ms, the worker's CPU ms, and the answer. CPU time is the figure
    that survives a loaded machine; wall time is what a client waits."""
    cpu = cpu_seconds(worker_pid)
    started = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=600)
    elapsed = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed, (cpu_seconds(worker_pid) - cpu) * 1000, r.json()


def through_pool(model: str, vocab: llama_cpp.Llama, repeats: int,
                 sizes: tuple[int, ...]) -> list[list]:
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        pool = Pool(Path(model), Path(run_dir), workers=1)
        try:
            worker_pid = pool.workers[0].pid
            rss_before = rss_mib(worker_pid)
            wall, cpu, _ = post_ms(pool.url, {"input": text_of(vocab, 10)},
                                   worker_pid)
            rss_after = rss_mib(worker_pid)
            rows.append(["first request (makes the context), 10 tokens",
                         wall, cpu, None, None])
            cases = [(f"1 input of {n} tokens", [text_of(vocab, n)])
                     for n in sizes]
            cases.append(("batch of 32 inputs of 10 tokens",
                          [text_of(vocab, 10)] * 32))
            for name, inputs in cases:
                runs = [post_ms(pool.url, {"input": inputs}, worker_pid)
                        for _ in range(repeats)]
                wall = statistics.median(r[0] for r in runs)
                cpu = statistics.median(r[1] for r in runs)
                tokens = runs[0][2]["usage"]["prompt_tokens"]
                rows.append([name, wall, cpu, len(inputs) * 1000 / cpu,
                             tokens * 1000 / cpu])
            rows.append(["worker RSS before / after first embedding (MiB)",
                         None, None, None, f"{rss_before:.0f} / {rss_after:.0f}"])
        finally:
            pool.stop()
    return rows


def in_process(model: str, repeats: int) -> list[list]:
    llama = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=1,
                            n_threads_batch=1, verbose=False)
    rows = []
    tokens_100 = llama.tokenize((WORD * 99).encode(), add_bos=True, special=True)
    # This pool's way: the second, pooled context.
    embedder = Embedder(llama, PromptBuilder(llama, None), n_threads=1)
    started = time.process_time()
    embedder._context()
    rows.append(["make the embedding context (once per worker)",
                 (time.process_time() - started) * 1000])
    # The alternative: toggle embeddings on the generation context. Measured
    # alternately with the second context, so load drifts hit both alike.
    ctx = llama._ctx
    batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
    n_embd = llama.n_embd()

    def second_context() -> None:
        embedder.vector(tokens_100, 2)

    def toggled() -> None:
        llama_cpp.llama_set_embeddings(ctx.ctx, True)
        ctx.kv_cache_clear()
        batch.reset()
        batch.add_sequence(tokens_100, 0, True)
        ctx.decode(batch)
        per_token = np.stack([
            np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx.ctx, i),
                                  shape=(n_embd,))
            for i in range(len(tokens_100))])
        normalize(per_token.mean(axis=0), 2)
        llama_cpp.llama_set_embeddings(ctx.ctx, False)

    def prefill_only() -> None:
        # The same tokens as a prompt: logits of the last token only.
        llama.reset()
        ctx.kv_cache_clear()
        llama.eval(tokens_100)

    times: dict[str, list[float]] = {"second": [], "toggled": [], "prefill": []}
    for _ in range(repeats):
        for name, fn in (("second", second_context), ("toggled", toggled),
                         ("prefill", prefill_only)):
            started = time.process_time()  # all threads of this process
            fn()
            times[name].append((time.process_time() - started) * 1000)
    n = len(tokens_100)
    rows.append([f"second context: 1 input of {n} tokens",
                 statistics.median(times["second"])])
    rows.append([f"toggled generation context: 1 input of {n} tokens",
                 statistics.median(times["toggled"])])
    rows.append([f"for scale: a {n}-token prompt's prefill (last logits only)",
                 statistics.median(times["prefill"])])
    # What toggling costs the next turn: its cached prefix is gone.
    conversation = llama.tokenize((WORD * 999).encode(), add_bos=True)
    times = []
    for _ in range(max(1, repeats // 3)):
        llama.reset()
        ctx.kv_cache_clear()
        started = time.process_time()
        llama.eval(conversation)
        times.append((time.process_time() - started) * 1000)
    rows.append([f"toggled: re-prefill of a {len(conversation)}-token conversation "
                 "after each embedding", statistics.median(times)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats, no 500-token input (a smoke run)")
    args = parser.parse_args()
    sizes = (10, 100) if args.quick else (10, 100, 500)
    if args.quick:
        args.repeats = 2
    if args.model is None:
        from llamapool.supervisor import default_model_path

        args.model = default_model_path()
    vocab = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    print(f"model: {Path(args.model).name}, 1 thread, {args.repeats} repeats "
          f"(median), load average {os.getloadavg()[0]:.1f}\n", file=sys.stderr)
    print(md_table(["through the pool", "wall ms", "worker CPU ms",
                    "inputs per CPU-s", "tokens per CPU-s"],
                   through_pool(args.model, vocab, args.repeats, sizes)))
    print()
    print(md_table(["in one process", "CPU ms"], in_process(args.model, args.repeats)))


if __name__ == "__main__":
    main()
