"""This checkout against another one, at concurrency 2, in interleaved rounds:
does a change make the pool faster?

    git worktree add /tmp/before <commit>    # or a clone checked out there
    make bench-ab BENCH_ARGS="--before /tmp/before"
    # or: python -m tests.bench.bench_ab --before /tmp/before
    # tracing on against off, one checkout: --ttft --traced --before .
    # a setting of the environment, one checkout: --before . --env GOMP_SPINCOUNT=20000

Both pools (``llamapool up --workers 2 --threads 1``, or ``--threads auto``;
the default model) are up at once, with llama-server ``-np 2 -t 2`` beside
them under ``--llama-server``, each warmed up first; an idle pool costs no CPU. Each round runs both for
``--duration`` seconds, in an order that alternates from round to round, and
the printed figure is each round's ratio of this checkout's tokens/s to the
other's, with their median and mean. On this shared 2-core machine one
15-second run moves by ±10%, so a change of a few percent shows only as the
ratios of many rounds leaning one way (BENCHMARKS.md section 15: 54 rounds
read 0.976, and three A/A runs of one commit against itself 0.97-0.99).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from llamapool.loadgen import percentile
from tests.bench import harness
from tests.bench.bench_overhead import PROMPT as TTFT_PROMPT
from tests.bench.bench_shapes import LLAMA_SERVER, NO_REPACK
from tests.bench.bench_throughput import PROMPT
from tests.bench.otlp_sink import OtlpSink


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, metavar="DIR",
                        help="the other checkout (its llamapool code is run)")
    parser.add_argument("--model", default=None,
                        help="GGUF, or tiny: the test model (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per request (default 64; with --ttft, 1)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--threads", default="1",
                        help="the workers' --threads: a count, or auto")
    parser.add_argument("--workers", type=int, default=2,
                        help="the pools' workers (up --workers)")
    parser.add_argument("--slots-per-worker", type=int, default=1,
                        help="each worker's batched slots (up's shape on AMX: "
                             "--workers 1 --slots-per-worker 2 --threads 2)")
    parser.add_argument("--llama-server", action="store_true",
                        help="run llama-server -np 2 -t 2 in the same rounds "
                             "too (--no-repack on AMX, as the workers there)")
    parser.add_argument("--duration", type=float, default=12.0,
                        help="seconds per pool per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds of 3 s, 16 tokens")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set this in the environment of this checkout's "
                             "pool only (repeatable); with --before . it weighs "
                             "a setting such as GOMP_SPINCOUNT on one commit")
    parser.add_argument("--ttft", action="store_true",
                        help="compare the time to first token, one request at a time")
    parser.add_argument("--requests", type=int, default=400,
                        help="with --ttft: requests per pool")
    parser.add_argument("--traced", action="store_true",
                        help="with --ttft: this checkout's pool exports every "
                             "request's trace to an OTLP/HTTP sink here")
    args = parser.parse_args(argv)
    try:
        extra_env = dict(item.split("=", 1) for item in args.env)
    except ValueError:
        parser.error("--env takes NAME=VALUE")
    if args.ttft and extra_env:
        parser.error("--env applies to the throughput rounds, not to --ttft")
    if args.quick:
        args.rounds, args.duration, args.tokens, args.requests = 2, 3.0, 16, 20
    model = harness.model_path(args.model)
    if args.ttft:
        return compare_ttft(model, args.before, args.requests, args.tokens or 1,
                            traced=args.traced)
    args.tokens = args.tokens or 64
    settings = "".join(f", {item}" for item in args.env)
    this = f"this checkout ({harness.checkout_commit('.')}{settings})"
    other = f"--before ({harness.checkout_commit(args.before)})"
    this_env = {**os.environ, **extra_env} if extra_env else None
    shape = {"workers": args.workers, "threads": args.threads,
             "slots_per_worker": args.slots_per_worker}
    starts = {
        # Both through ``checkout``, so that both import their code the same
        # way (working directory and PYTHONPATH).
        this: lambda: harness.llamapool_up(model, **shape, checkout=os.getcwd(),
                                           env=this_env),
        other: lambda: harness.llamapool_up(model, **shape, checkout=args.before),
    }
    if args.llama_server:
        starts[LLAMA_SERVER] = lambda: harness.llama_server(
            model, slots=2, n_threads=2, extra=NO_REPACK)
    rates: dict[str, list[float]] = {name: [] for name in starts}
    ttfts: dict[str, list[float]] = {name: [] for name in starts}
    with contextlib.ExitStack() as stack:
        urls = harness.start_warm(stack, starts, concurrency=args.concurrency,
                                  prompt=PROMPT)
        for r in range(args.rounds):
            names = list(starts)
            for name in names[r % len(names):] + names[:r % len(names)]:
                report, ttft_s = harness.run_load_ttfts(
                    urls[name], concurrency=args.concurrency, requests=None,
                    duration_s=args.duration, max_tokens=args.tokens,
                    prompt=PROMPT, ignore_eos=True, wait_after_503_s=0.05)
                rates[name].append(report["output_tokens_per_s"])
                ttfts[name] += ttft_s
            print(f"round {r + 1}, tokens/s: {this} {rates[this][-1]:.1f}, "
                  f"{other} {rates[other][-1]:.1f}", flush=True)
    ratios = [a / b for a, b in zip(rates[this], rates[other])]
    print(f"\n## {this} against {other}: --workers {args.workers} "
          f"--slots-per-worker {args.slots_per_worker} --threads {args.threads}, "
          f"concurrency {args.concurrency}, "
          f"{args.rounds} interleaved rounds ({os.path.basename(model)}, "
          f"{args.tokens} tokens, ignore_eos, {args.duration:.0f} s per pool per "
          f"round)\n")
    print(harness.md_table(
        ["", "median", "mean", "per round", "TTFT p50 ms", "p90", "p99"],
        [*([f"{name} tokens/s", statistics.median(rates[name]),
            statistics.mean(rates[name]), " ".join(f"{v:.1f}" for v in rates[name]),
            *(1000 * percentile(ttfts[name], q) for q in (50, 90, 99))]
           for name in starts),
         ["ratio, this / before", statistics.median(ratios), statistics.mean(ratios),
          " ".join(f"{v:.3f}" for v in ratios), "", "", ""],
         *([f"ratio, {name} / llama-server", statistics.median(to_server),
            statistics.mean(to_server), " ".join(f"{v:.3f}" for v in to_server),
            "", "", ""]
           for name, to_server in _same_round_ratios(rates, LLAMA_SERVER).items())]))
    below = sum(1 for v in ratios if v < 1)
    print(f"\n{below} of {len(ratios)} rounds below 1.")
    return 0


def _same_round_ratios(rates: dict[str, list[float]],
                       base: str) -> dict[str, list[float]]:
    """Each other target's tokens/s over ``base``'s, round by round (none
    when ``base`` did not run)."""
    if base not in rates:
        return {}
    return {name: [a / b for a, b in zip(values, rates[base])]
            for name, values in rates.items() if name != base}


def compare_ttft(model: str, before: str, requests: int, tokens: int,
                 traced: bool = False) -> int:
    """Time to first token and CPU per request, this checkout against
    ``before``, one request at a time, alternating request by request.
    ``traced``: this checkout's pool traces every request (``OtlpSink``)."""
    this = f"this checkout ({harness.checkout_commit('.')}{', traced' if traced else ''})"
    other = f"--before ({harness.checkout_commit(before)})"
    checkouts = {this: os.getcwd(), other: before}
    ttfts: dict[str, list[float]] = {name: [] for name in checkouts}
    cpu_s = dict.fromkeys(checkouts, 0.0)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(OtlpSink()) if traced else None
        pools = {}
        for name, checkout in checkouts.items():
            env = {**os.environ, **sink.env()} if sink and name == this else None
            server, url = harness.llamapool_up(model, workers=1, threads=1,
                                               checkout=checkout, env=env)
            stack.callback(server.stop)
            pools[name] = (server, url)
        for _ in range(10):  # warm up: connections, caches, the first prefill
            for _, url in pools.values():
                harness.stream_once(url, TTFT_PROMPT, tokens)
        for i in range(requests):
            order = [this, other] if i % 2 == 0 else [other, this]
            for name in order:
                server, url = pools[name]
                cpu_before = harness.tree_cpu_seconds(server.pid)
                ttfts[name].append(harness.stream_once(url, TTFT_PROMPT, tokens).ttft_s)
                cpu_s[name] += harness.tree_cpu_seconds(server.pid) - cpu_before
    diffs = [a - b for a, b in zip(ttfts[this], ttfts[other])]
    print(f"\n## Time to first token, {this} against {other}: {requests} "
          f"streamed requests each, one at a time, alternating "
          f"({os.path.basename(model)}, {tokens} token(s), one worker each)\n")
    rows = []
    for name in checkouts:
        values = ttfts[name]
        rows.append([name, 1000 * percentile(values, 50), 1000 * percentile(values, 90),
                     1000 * percentile(values, 99), 1000 * cpu_s[name] / requests])
    rows.append(["paired difference, this - before",
                 1000 * percentile(diffs, 50), "", "", ""])
    print(harness.md_table(["", "TTFT p50, ms", "p90", "p99", "CPU per request, ms"],
                           rows))
    if sink is not None:
        print(f"\n{sink.spans} spans exported to the sink "
              f"({sink.spans / ((requests + 10) or 1):.1f} per traced request).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
