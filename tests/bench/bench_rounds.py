"""Concurrency 2, side by side in rounds: the pool, llama-server and the
ceiling, interleaved so that this machine's drift falls on all alike.

    make bench-rounds      # or: python -m tests.bench.bench_rounds

``make bench-throughput`` runs its targets one after another, minutes apart,
and this shared machine's speed drifts by 10-30% over minutes: a 5% gap
(issue 15's 0.95 of the ceiling) cannot be read through that. Here every
server is up at once (an idle one costs no CPU) and each round runs every
target for ``--duration`` seconds in a rotating order, then the ceiling (two
processes each running a bare ``Llama.generate`` loop with one thread, no
HTTP). Printed: each target's median tokens/s over the rounds, and the
median of its per-round ratios to the ceiling, to llama-server and to the
floor measured in the same round; then each server's time to first token,
p50 and p99 over every request of every round.

The floor (``tests.bench.floor_pool``) has the pool's processes and ZeroMQ
hops and none of its code: what it loses against the ceiling is what that
shape costs on this machine, whatever the code; what ``llamapool up`` loses
against the floor is ours. llama-server runs twice: as it starts by default
(flash attention ``auto``, so on for this CPU) and with ``-fa off``. The
pool runs with ``--flash-attn off``, as the ceiling's loops do (the pool's
default is on, docs/operations.md, "Flash attention").

``--flash-attn`` adds the pool and the ceilings with flash attention on, to
compare at llama-server's default settings too.

``--batched`` adds one worker of two batched slots (all cores; with
``--flash-attn``, also with flash attention on) and its own ceiling: the
worker's engine decoding two sequences in a bare loop
(``tests.bench.batched_ceiling``). On a CPU with AMX llama-server runs with
``--no-repack``, as the workers' ``--repack auto`` does there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from llamapool.loadgen import percentile
from tests.bench import harness
from tests.bench.batched_ceiling import batched_generate
from tests.bench.bench_throughput import PROMPT
from workers.model.weight_repack import cpu_has_amx

CEILING = "ceiling: 2 × Llama.generate (1 thread each)"
CEILING_FA = "ceiling, flash attention on: 2 × Llama.generate (1 thread each)"
LLAMA_SERVER = "llama-server -np 2 -t 2"
FLOOR = "floor: the pool's processes and hops, no work (2 × 1 thread)"
BATCHED_CEILING = "batched ceiling: one context, 2 sequences, bare loop"
BATCHED_CEILING_FA = "batched ceiling, flash attention on"
#: The pool's rows run as the ceiling's loops do (its default is on).
FA_OFF = ("--flash-attn", "off")


def targets(model: str, args) -> tuple[dict, dict]:
    """The servers to start (name -> start) and the ceilings to measure
    each round (name -> tokens/s), as the flags ask."""
    no_repack = ("--no-repack",) if cpu_has_amx() else ()
    cores = os.cpu_count() or 1
    starts = {
        "llamapool up (2 workers × 1 thread, --flash-attn off)":
            lambda: harness.llamapool_up(model, workers=2, threads=1, extra=FA_OFF),
        "llamapool up (2 workers, --threads auto, --flash-attn off)":
            lambda: harness.llamapool_up(model, workers=2, threads="auto",
                                         extra=FA_OFF),
        LLAMA_SERVER: lambda: harness.llama_server(model, slots=2, n_threads=2,
                                                   extra=no_repack),
        "llama-server -np 2 -t 2 -fa off": lambda: harness.llama_server(
            model, slots=2, n_threads=2, extra=(*no_repack, "-fa", "off")),
        FLOOR: lambda: harness.floor_pool(model),
    }
    if args.before:
        commit = harness.checkout_commit(args.before)
        starts[f"llamapool up at {commit} (2 workers × 1 thread, --flash-attn off)"] = (
            lambda: harness.llamapool_up(model, workers=2, threads=1, extra=FA_OFF,
                                         checkout=args.before))
    if args.flash_attn:
        starts["llamapool up (2 workers × 1 thread, --flash-attn on)"] = (
            lambda: harness.llamapool_up(model, workers=2, threads=1,
                                         extra=("--flash-attn", "on")))
    if args.batched:
        for flash in (FA_OFF, ("--flash-attn", "on"))[:1 + args.flash_attn]:
            starts[f"llamapool up (1 worker × 2 batched slots, {' '.join(flash)})"] = (
                lambda flash=flash: harness.llamapool_up(
                    model, workers=1, threads=cores, slots_per_worker=2, extra=flash))

    def generate(flash_attn: bool) -> float:
        return harness.parallel_generate(
            model, processes=2, n_threads=1, prompt=PROMPT, n_tokens=args.tokens,
            reps=args.ceiling_reps, flash_attn=flash_attn)["output_tokens_per_s"]

    def batched(flash_attn: bool) -> float:
        return batched_generate(
            model, n_slots=2, n_threads=cores, prompt=PROMPT, n_tokens=args.tokens,
            reps=args.ceiling_reps, flash_attn=flash_attn)["output_tokens_per_s"]

    ceilings = {CEILING: lambda: generate(False)}
    if args.flash_attn:
        ceilings[CEILING_FA] = lambda: generate(True)
    if args.batched:
        ceilings[BATCHED_CEILING] = lambda: batched(False)
        if args.flash_attn:
            ceilings[BATCHED_CEILING_FA] = lambda: batched(True)
    return starts, ceilings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--duration", type=float, default=15.0,
                        help="seconds per target per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ceiling-reps", type=int, default=4,
                        help="generations per ceiling process per round")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds of 3 s, 16 tokens")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="also run `llamapool up` (2 × 1 thread) from the "
                             "llamapool of another checkout, in every round")
    parser.add_argument("--flash-attn", action="store_true",
                        help="also run the pool (2 × 1 thread) and the ceiling "
                             "with flash attention on, as llama-server's default")
    parser.add_argument("--batched", action="store_true",
                        help="also run one worker of 2 batched slots and its "
                             "bare-loop ceiling")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.tokens, args.ceiling_reps = 2, 3.0, 16, 1
    model = args.model or harness.default_model()
    starts, ceilings = targets(model, args)
    rates: dict[str, list[float]] = {name: [] for name in [*starts, *ceilings]}
    ttfts: dict[str, list[float]] = {name: [] for name in starts}
    with contextlib.ExitStack() as stack:
        urls = harness.start_warm(stack, starts, concurrency=args.concurrency,
                                  prompt=PROMPT)
        names = list(urls)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                report, ttft_s = harness.run_load_ttfts(
                    urls[name], concurrency=args.concurrency, requests=None,
                    duration_s=args.duration, max_tokens=args.tokens,
                    prompt=PROMPT, ignore_eos=True, wait_after_503_s=0.05)
                rates[name].append(report["output_tokens_per_s"])
                ttfts[name] += ttft_s
            for name, measure in ceilings.items():
                rates[name].append(measure())
            print(f"round {r + 1}, tokens/s: " + "; ".join(
                f"{name}: {values[-1]:.1f}" for name, values in rates.items()),
                flush=True)

    def per_round(name: str, against: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[name], rates[against]))

    print(f"\n## Concurrency {args.concurrency}, {args.rounds} interleaved rounds "
          f"({os.path.basename(model)}, {args.tokens} tokens, ignore_eos, "
          f"{args.duration:.0f} s per target per round, {os.cpu_count()} cores)\n")
    extra_ceiling = [name for name in ceilings if name != CEILING]
    print(harness.md_table(
        ["target", "tokens/s (median)", "per round", "× ceiling (same round)",
         *(f"× {name.split(':')[0]} (same round)" for name in extra_ceiling),
         "× llama-server -t 2 (same round)", "× floor (same round)"],
        [[name, statistics.median(values), " ".join(f"{v:.1f}" for v in values),
          per_round(name, CEILING),
          *(per_round(name, other) for other in extra_ceiling),
          per_round(name, LLAMA_SERVER), per_round(name, FLOOR)]
         for name, values in rates.items()]))
    print(f"\nTime to first token over all rounds, concurrency {args.concurrency}:\n")
    print(harness.md_table(
        ["server", "requests", "TTFT p50 ms", "TTFT p99 ms"],
        [[name, len(values), 1000 * percentile(values, 50),
          1000 * percentile(values, 99)] for name, values in ttfts.items()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
