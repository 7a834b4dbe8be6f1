"""Throughput of the pool vs llama.cpp's own server vs the ceiling.

    make bench-throughput   # or: python -m tests.bench.bench_throughput

* ``llamapool up --workers 2`` with ``--threads auto`` (``up``'s default: a
  busy worker uses the host's cores / busy workers, changed mid-job) and
  with ``--threads 1`` (the default before issue 32), and ``--workers 1
  --slots-per-worker 2`` (one batched context, all cores),
  driven by ``llamapool bench`` at concurrency 1, 2 and 4 (at 4, two
  clients at a time are refused with 503, counted apart, and ask again after
  ``--wait-after-503``: retrying at once would spin and steal CPU from the
  workers on a small machine);
* the batched worker again with ``--flash-attn off``, and ``llama-server
  -np 2 -t 2 -fa off``: both defaults turn flash attention on (the pool's
  ``on``, llama-server's ``-fa auto`` on every CPU build), so these two
  rows give the comparison with it off on both sides too;
* ``llama-server -np 2`` with ``-t 2`` and with ``-t 1`` (``--no-repack``
  on an AMX CPU, where the workers run without repacking), built from the
  llama.cpp vendored in the installed llama-cpp-python
  (``tests.bench.llama_server``; built once, cached), same loads; it queues
  what its two slots cannot take instead of refusing;
* with ``--llama-cpp-python``: llama-cpp-python's own server too
  (``--n_threads 2``, one request at a time);
* the ceiling: two processes each running a bare ``Llama.generate`` loop
  with one thread, side by side, no HTTP at all (run before and after the
  servers; the better run counts).

* with ``--curve``: the batch-size curve instead, one worker of K = 1, 2,
  4, 8 slots (all cores) at concurrency K.

Same model (Gemma 3 270M by default), same prompt, same client, ``--tokens``
tokens per request with ``ignore_eos``. Each load runs for ``--duration``
seconds.
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness
from workers.model.weight_repack import cpu_has_amx

PROMPT = "Write a short story about a llama who learns to fly."
CONCURRENCY = (1, 2, 4)


def load_rows(name: str, url: str, args,
              levels: tuple[int, ...] = CONCURRENCY) -> list[list]:
    """One row per concurrency level; "× ceiling" is filled in later."""
    rows = []
    harness.warm_up(url, max(levels), PROMPT)
    for c in levels:
        report = harness.run_load(
            url, concurrency=c, requests=None, duration_s=args.duration,
            max_tokens=args.tokens, prompt=PROMPT, ignore_eos=True,
            wait_after_503_s=args.wait_after_503,
        )
        rows.append([
            name, c, report["requests_per_s"], report["output_tokens_per_s"], None,
            report["ttft_ms"]["p50"], report["ttft_ms"]["p99"],
            report["latency_ms"]["p50"], report["rejections_per_s"],
            report["requests_failed"],
        ])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds per load level")
    parser.add_argument("--wait-after-503", type=float, default=0.05,
                        help="a refused client's pause before it asks again")
    parser.add_argument("--ceiling-reps", type=int, default=20,
                        help="generations per process for the ceiling")
    parser.add_argument("--llama-cpp-python", action="store_true",
                        help="also measure llama-cpp-python's own server")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 3 s per level, 16 tokens, 2 ceiling reps")
    parser.add_argument("--curve", action="store_true",
                        help="the batch-size curve: one worker, K = 1, 2, 4, 8 "
                             "slots at concurrency K")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.tokens, args.ceiling_reps = 3.0, 16, 2
    model = args.model or harness.default_model()
    if args.curve:
        return batch_curve(model, args)
    cores = os.cpu_count() or 1
    no_repack = ("--no-repack",) if cpu_has_amx() else ()

    def measure_ceiling() -> dict:
        return harness.parallel_generate(model, processes=2, n_threads=1,
                                         prompt=PROMPT, n_tokens=args.tokens,
                                         reps=args.ceiling_reps)

    # Measured before and after the servers; the better run is the ceiling
    # (on a shared machine a neighbour's burst only ever lowers it).
    ceilings = [measure_ceiling()]
    targets = [
        ("llamapool up (2 workers, --threads auto)",
         lambda: harness.llamapool_up(model, workers=2, threads="auto")),
        ("llamapool up (2 workers × 1 thread)",
         lambda: harness.llamapool_up(model, workers=2, threads=1)),
        (f"llamapool up (1 worker × 2 batched slots, {cores} threads)",
         lambda: harness.llamapool_up(model, workers=1, threads=cores,
                                      slots_per_worker=2)),
        (f"llamapool up (1 worker × 2 batched slots, {cores} threads, "
         "--flash-attn off)",
         lambda: harness.llamapool_up(model, workers=1, threads=cores,
                                      slots_per_worker=2,
                                      extra=("--flash-attn", "off"))),
        (f"llama-server -np 2 -t 2 {' '.join(no_repack)}",
         lambda: harness.llama_server(model, slots=2, n_threads=2, extra=no_repack)),
        (f"llama-server -np 2 -t 2 {' '.join(no_repack)} -fa off",
         lambda: harness.llama_server(model, slots=2, n_threads=2,
                                      extra=(*no_repack, "-fa", "off"))),
        (f"llama-server -np 2 -t 1 {' '.join(no_repack)}",
         lambda: harness.llama_server(model, slots=2, n_threads=1, extra=no_repack)),
    ]
    if args.llama_cpp_python:
        targets.append(("llama-cpp-python server (2 threads)",
                        lambda: harness.llama_cpp_server(
                            model, n_threads=2,
                            extra=("--interrupt_requests", "False"))))
    rows = []
    for name, start in targets:
        server, url = start()
        try:
            rows += load_rows(name, url, args)
        finally:
            server.stop()
    ceilings.append(measure_ceiling())
    ceiling = max(ceilings, key=lambda c: c["output_tokens_per_s"])
    for row in rows:
        row[4] = harness.ratio(row[3], ceiling["output_tokens_per_s"])
    rows.append(["ceiling: 2 × Llama.generate (1 thread each)", "-",
                 ceiling["requests_per_s"], ceiling["output_tokens_per_s"], 1.0,
                 None, None, None, None, None])

    print(f"## Throughput ({os.path.basename(model)}, {args.tokens} tokens, "
          f"ignore_eos, {args.duration:.0f} s per level, {os.cpu_count()} cores, "
          f"refused clients wait {args.wait_after_503} s)\n")
    print(harness.md_table(
        ["target", "concurrency", "completed req/s", "output tokens/s",
         "× ceiling", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "503/s",
         "failed"],
        rows,
    ))
    print("\nceiling runs (output tokens/s): "
          + ", ".join(f"{c['output_tokens_per_s']:.1f}" for c in ceilings))
    return 0


def batch_curve(model: str, args) -> int:
    """One worker of K batched slots (all cores) at concurrency K."""
    cores = os.cpu_count() or 1
    rows = []
    for k in (1, 2, 4, 8):
        server, url = harness.llamapool_up(model, workers=1, threads=cores,
                                           slots_per_worker=k)
        try:
            rows += load_rows(f"1 worker × {k} slots", url, args, levels=(k,))
        finally:
            server.stop()
    base = rows[0][3]
    for row in rows:
        row[4] = harness.ratio(row[3], base)
    print(f"## Batch-size curve ({os.path.basename(model)}, {args.tokens} tokens, "
          f"ignore_eos, {args.duration:.0f} s per level, {cores} cores, "
          f"{'AMX' if cpu_has_amx() else 'no AMX'})\n")
    print(harness.md_table(
        ["target", "concurrency", "completed req/s", "output tokens/s",
         "× K=1", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "503/s",
         "failed"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
