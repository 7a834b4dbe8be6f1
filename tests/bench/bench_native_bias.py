"""What a ban costs per token: a Python logits processor vs llama.cpp's sampler.

    make bench-native-bias   # or: python -m tests.bench.bench_native_bias

``ignore_eos`` (which every benchmark's client sends) and ``logit_bias``
change a few logits. llama-cpp-python takes such changes only as a Python
processor, called per token on a view of the whole vocabulary; the worker
now hands them to llama.cpp's own logit-bias sampler instead
(``workers.model.native_bias``), as llama-server does. One ``Llama``, the
same prompt, the pool's sampling defaults, rounds alternating between the
two ways of banning the end-of-generation tokens (and, for scale, no ban):
the first token (the prompt's last token evaluated again and sampled, its
prefix reused from the KV cache as the worker reuses it for a repeated
prompt) and each token after it, medians over the rounds.
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness
from tests.bench.bench_overhead import PROMPT


def timed_generation(llama, processors, n_tokens: int) -> tuple[float, float]:
    """(first token, per later token), seconds. The prompt's KV cache is
    reused, as the worker reuses it for a repeated prompt: the first token
    is one evaluation of the prompt's last token and one sample."""
    run = harness.generate_loop(llama, PROMPT, n_tokens, processors)
    return run.ttft_s, 1 / run.decode_tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="GGUF, or tiny: the test model (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 2, 8
    model = harness.model_path(args.model)
    llama = harness.load_llama(model, args.threads)
    ways = {
        "Python processor (llama-cpp-python's way)":
            lambda: harness.ban_eog(llama, in_python=True),
        "llama.cpp's logit-bias sampler (the worker's way)":
            lambda: harness.ban_eog(llama),
        "no ban (for scale: a request without ignore_eos)": lambda: None,
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for r in range(args.rounds + 1):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            llama.logit_bias = {}
            processors = ways[name]()
            result = timed_generation(llama, processors, args.tokens)
            if r:  # round 0 warms up
                times[name].append(result)
    print(f"## Banning the end tokens: {args.rounds} alternating rounds "
          f"({os.path.basename(model)}, {args.threads} thread(s), "
          f"{args.tokens} tokens, medians)\n")
    rows = [[name, 1000 * harness.median([t[0] for t in runs]),
             1000 * harness.median([t[1] for t in runs])]
            for name, runs in times.items()]
    python_way, native_way, _ = rows
    rows.append(["saved by llama.cpp's sampler", python_way[1] - native_way[1],
                 python_way[2] - native_way[2]])
    print(harness.md_table(["", "first token, ms", "per later token, ms"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
