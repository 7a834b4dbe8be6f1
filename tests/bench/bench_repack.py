"""What weight repacking is worth on this CPU: ``--repack on`` against ``off``.

    make bench-repack   # or: python -m tests.bench.bench_repack

``--repack auto`` turns llama.cpp's repacking off only on a CPU with AMX
(``workers.model.weight_repack``: its AMX kernel crashes at the vendored
llama.cpp). This measures what that costs, or what keeping it elsewhere
saves: the model loaded twice in one process, as the worker loads it, with
and without repacking, in alternating rounds (the machine drifts); per
round a cold prefill of the benchmark prompt and ``--tokens`` decoded
tokens. Medians; the CPU is named, since the answer depends on it.
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness
from tests.bench.bench_overhead import PROMPT as SENTENCE
from workers.model.weight_repack import cpu_flags, cpu_has_amx

#: About 100 tokens: a prefill is a batch, where repacked kernels differ most.
PROMPT = " ".join([SENTENCE] * 8)


def load(model: str, threads: int, repack: bool):
    from workers.model.llama_engine import EngineLlama

    return EngineLlama(model_path=model, n_ctx=2048, n_threads=threads,
                       n_threads_batch=threads, use_extra_bufts=repack,
                       verbose=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="GGUF, or tiny: the test model (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds")
    parser.add_argument("--force", action="store_true",
                        help="on a CPU with AMX too (repack on may crash there)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 2, 8
    model = harness.model_path(args.model)
    if cpu_has_amx() and not args.force:
        print("This CPU has AMX: repacking on takes llama.cpp's AMX kernel, which "
              "crashes on Q4_K (llama.cpp #20824). --force runs it anyway.")
        return 1
    models = {"repack on": load(model, args.threads, True),
              "repack off": load(model, args.threads, False)}
    runs: dict[str, list[harness.LoopTiming]] = {name: [] for name in models}
    for r in range(args.rounds + 1):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            llama = models[name]
            llama.reset()  # a cold prefill each time
            result = harness.generate_loop(llama, PROMPT, args.tokens, None)
            if r:  # round 0 warms up
                runs[name].append(result)
    flags = sorted(f for f in cpu_flags() if f in {"avx2", "avx512f", "amx_int8"})
    print(f"## Weight repacking: {args.rounds} alternating rounds "
          f"({os.path.basename(model)}, {harness.cpu_name()} [{' '.join(flags)}], "
          f"{args.threads} thread(s), {args.tokens} tokens, medians)\n")
    rows = [[name,
             1000 * harness.median([t.ttft_s for t in timings]),
             harness.median([t.decode_tokens_per_s for t in timings])]
            for name, timings in runs.items()]
    on, off = rows
    rows.append(["on / off", harness.ratio(off[1], on[1]),
                 harness.ratio(on[2], off[2])])
    print(harness.md_table(["", "cold prefill + first token, ms",
                            "decode tokens/s"], rows))
    print("\n(on / off: how many times faster repacking makes each.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
