"""Overload without refusal (issue 31): closed-loop clients that do not retry,
against a pool that refuses at once and one whose broker lets jobs wait.

    python -m tests.bench.bench_overload            # make bench-overload

Side by side in one run, on the default model (or ``--model``), ``up`` with
``--workers 2``:

1. **Overload.** ``--clients`` closed-loop clients (each sends its next
   request when the last one ends, a 503 counts as failed) x
   ``--requests-each`` requests of ``--tokens`` tokens: completed tokens/s,
   the share of requests failed, TTFT p50/p99. For llamapool without a queue
   (503 at once, the seed's rule), with ``--queue-max`` (two one-slot
   workers, then one worker of two batched slots, ``up``'s default on an
   AMX CPU), and llama-server ``-np 2`` when its binary is built (``make
   llama-server``), at its default (flash attention on, as the pool's) and
   with ``-fa off``.
2. **Fairness.** With the queue on, key A runs 6 concurrent streams and key
   B one; B's TTFT against A's. Least-recent-service fairness should keep
   B's near one job's length; first come, first served (``--queue-order
   fifo``, run too) puts B behind A's whole backlog.

Say which CPU the figures come from (``grep -c amx /proc/cpuinfo``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os

from tests.bench import llama_server as llama_server_build
from tests.bench.harness import (
    cpu_name,
    llama_server,
    llamapool_up,
    md_table,
    model_path,
    run_load,
    warm_up,
)
from workers.model.weight_repack import cpu_has_amx

KEY_A, KEY_B = "sk-bench-a", "sk-bench-b"
PROMPT = "Write a short story about a lighthouse keeper."


def overload_row(name: str, url: str, args, api_key: str | None = None) -> list:
    report = run_load(url, concurrency=args.clients,
                      requests=args.clients * args.requests_each,
                      max_tokens=args.tokens, prompt=PROMPT, ignore_eos=True,
                      api_key=api_key)
    sent = report["requests_sent"]
    failed = sent - report["requests_completed"]
    ttft = report["ttft_ms"]
    return [name, f"{report['output_tokens_per_s']:.1f}",
            f"{100 * failed / sent:.0f}% ({failed} of {sent})",
            f"{ttft.get('p50', 0):.0f} / {ttft.get('p99', 0):.0f}"]


def fairness_rows(url: str, args) -> list[list]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(run_load, url, concurrency=6, requests=6 * args.requests_each,
                        max_tokens=args.tokens, prompt=PROMPT, ignore_eos=True,
                        api_key=KEY_A)
        b = pool.submit(run_load, url, concurrency=1, requests=args.requests_each,
                        max_tokens=args.tokens, prompt=PROMPT, ignore_eos=True,
                        api_key=KEY_B)
        reports = {"A (6 streams)": a.result(), "B (1 stream)": b.result()}
    return [[name, f"{r['ttft_ms'].get('p50', 0):.0f}", f"{r['ttft_ms'].get('p99', 0):.0f}",
             r["requests_completed"], r["requests_sent"] - r["requests_completed"],
             f"{r['latency_ms'].get('p50', 0):.0f}"]
            for name, r in reports.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-each", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", default="1", help="per worker (up's --threads)")
    args = parser.parse_args()
    model = model_path(args.model)
    keys = ("--api-key", KEY_A, "--api-key", KEY_B)
    queue = ("--queue-max", str(4 * args.clients), "--queue-timeout-s", "300")
    rows = []
    with contextlib.ExitStack() as stack:
        refusing, url = llamapool_up(model, 2, args.threads)
        stack.callback(refusing.stop)
        warm_up(url, 2, PROMPT)
        rows.append(overload_row("llamapool 2 workers, 503 at once (the default)",
                                 url, args))
        refusing.stop()
        waiting, url = llamapool_up(model, 2, args.threads, extra=(*keys, *queue))
        stack.callback(waiting.stop)
        rows.append(overload_row(f"llamapool 2 workers, --queue-max {4 * args.clients}",
                                 url, args, api_key=KEY_A))
        fair = [[f"fair: {name}", *rest] for name, *rest in fairness_rows(url, args)]
        waiting.stop()
        batched, url = llamapool_up(model, 1, os.cpu_count() or 1, slots_per_worker=2,
                                    extra=(*keys, *queue))
        stack.callback(batched.stop)
        warm_up(url, 2, PROMPT)
        rows.append(overload_row(f"llamapool, --queue-max {4 * args.clients}, "
                                 "1 worker × 2 batched slots", url, args,
                                 api_key=KEY_A))
        batched.stop()
        fifo_pool, url = llamapool_up(model, 2, args.threads, extra=(
            *keys, *queue, "--queue-order", "fifo"))
        stack.callback(fifo_pool.stop)
        warm_up(url, 2, PROMPT)
        fair += [[f"fifo: {name}", *rest] for name, *rest in fairness_rows(url, args)]
        fifo_pool.stop()
        if llama_server_build.binary_path().exists():
            # On AMX the vendored llama.cpp's repacked Q4_K matmul crashes
            # (the native-crash issue): both sides without repacking there,
            # as the workers' --repack auto already is.
            no_repack = ("--no-repack",) if cpu_has_amx() else ()
            # Its default -fa auto turns flash attention on, as the pool's
            # default does; the second row shows what that is worth to it.
            for flash in ((), ("-fa", "off")):
                server, url = llama_server(model, 2, 2, extra=(*no_repack, *flash))
                stack.callback(server.stop)
                rows.append(overload_row(
                    f"llama-server -np 2 -t 2 {' '.join((*no_repack, *flash))}",
                    url, args))
                server.stop()
        else:
            rows.append(["llama-server -np 2 -t 2", "not built (make llama-server)",
                         "-", "-"])
    print(f"\n## Overload: {args.clients} clients x {args.requests_each} requests of "
          f"{args.tokens} tokens, 2 slots ({cpu_name()})\n")
    print(md_table(["server", "completed tokens/s", "requests failed",
                    "TTFT p50 / p99, ms"], rows))
    print("\n## Fairness with the queue on: key A 6 streams, key B 1, "
          "least recent service (fair) and first come, first served (fifo)\n")
    print(md_table(["key", "TTFT p50, ms", "TTFT p99, ms", "completed", "failed",
                    "latency p50, ms"], fair))


if __name__ == "__main__":
    main()
