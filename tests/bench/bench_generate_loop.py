"""Per-token cost: ``create_completion(stream=True)`` vs a bare generate loop.

    make bench-generate-loop   # or: python -m tests.bench.bench_generate_loop

On the tiny test model the decode itself is nearly free, so what is left is
the Python each path runs per token. Three loops over the same ``Llama``,
alternating: llama-cpp-python's ``create_completion(stream=True)``, a bare
``Llama.generate`` loop, and the worker's own loop (``LlamaEngine.run``, which
adds incremental detokenising, stop strings and a cancel check), at several
output lengths: ``create_completion``'s cost per token grows with the length
of the output (it re-detokenises what it generated so far), so the ratio does
too. Why the worker owns its loop: docs/design.md, "llama-cpp-python behaviours".
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from protocol.payloads import GenerationRequest, Sampling
from tests.bench import harness
from tests.null_sink import NullSink

#: The pool's sampling defaults, for the create_completion baseline.
DEFAULTS = Sampling()

PROMPT = "Hello world"



def time_create_completion(llama, n_tokens: int, processors) -> tuple[float, int]:
    started = time.perf_counter()
    n = 0
    for _chunk in llama.create_completion(
        PROMPT, max_tokens=n_tokens, stream=True, logits_processor=processors,
        temperature=DEFAULTS.temperature, top_k=DEFAULTS.top_k,
        top_p=DEFAULTS.top_p, min_p=DEFAULTS.min_p,
        repeat_penalty=DEFAULTS.repeat_penalty,
    ):
        n += 1
    return time.perf_counter() - started, n


def time_generate(llama, n_tokens: int, processors) -> tuple[float, int]:
    run = harness.generate_loop(llama, PROMPT, n_tokens, processors)
    return run.total_s, run.tokens


def time_engine(engine, n_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    result = engine.run(GenerationRequest("completion", PROMPT, max_tokens=n_tokens,
                                          sampling=Sampling(ignore_eos=True)),
                        NullSink())
    return time.perf_counter() - started, result.completion_tokens


def measure(loops: dict, reps: int) -> dict[str, tuple[float, set[int]]]:
    """Median µs/token and the token counts seen, per loop, alternating."""
    per_token_us: dict[str, list[float]] = {name: [] for name in loops}
    counts: dict[str, set[int]] = {name: set() for name in loops}
    for loop in loops.values():
        loop()  # warm-up
    for _ in range(reps):
        for name, loop in loops.items():
            seconds, n = loop()
            per_token_us[name].append(seconds / max(1, n) * 1e6)
            counts[name].add(n)
    return {name: (harness.median(v), counts[name]) for name, v in per_token_us.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 512],
                        help="output lengths to measure (create_completion's cost "
                             "per token grows with the length)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 repetition of 64 and 128 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.reps = [64, 128], 1
    from workers.model.llama_engine import LlamaEngine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = harness.tiny_model(Path(tmp))
        llama = harness.load_llama(model, n_threads=1)
        processors = harness.ban_eog(llama)
        engine = LlamaEngine(model, n_threads=1)
        for n_tokens in args.tokens:
            loops = {
                "create_completion(stream=True)":
                    lambda n=n_tokens: time_create_completion(llama, n, processors),
                "bare Llama.generate loop":
                    lambda n=n_tokens: time_generate(llama, n, processors),
                "LlamaEngine.run (worker loop)":
                    lambda n=n_tokens: time_engine(engine, n),
            }
            results = measure(loops, args.reps)
            bare = results["bare Llama.generate loop"][0]
            for name, (us, counts) in results.items():
                rows.append([n_tokens, name, us, 1e6 / us, harness.ratio(us, bare),
                             "/".join(str(c) for c in sorted(counts))])

    print(f"## Per-token cost on the tiny model (ignore_eos, 1 thread, median of "
          f"{args.reps} alternating runs)\n")
    print(harness.md_table(["max_tokens", "loop", "µs/token", "tokens/s",
                            "× bare generate", "chunks/tokens"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
