"""Where the CPU goes per generated token: every process of the pool, and
the client.

    make bench-cpu-per-token   # or: python -m tests.bench.bench_cpu_per_token

``llamapool up --workers 2 --threads 1`` on the default model, driven at
concurrency 2 by ``llamapool bench`` (streamed, ``--tokens`` per request,
``ignore_eos``) for ``--duration`` seconds. For each process (broker, each
worker, the gunicorn master and its workers, the supervisor, the client
itself) it reads from ``/proc`` before and after the load:

* CPU time (user + system), per generated token;
* context switches of all its threads, voluntary (a thread went to sleep:
  each is a wake-up later) and involuntary (the scheduler took the core away:
  on a 2-core host that is usually a worker losing its core to us), per
  token.

On 2 cores the two 1-thread workers own both cores, so every microsecond
and every wake-up of the other processes per token is taken from a worker.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from tests.bench import harness

PROMPT = "Write a short story about a llama who learns to fly."


def _threads_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches over all threads of ``pid``."""
    vol = invol = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except OSError:
            pass
    return vol, invol


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        if comm.startswith("floor-"):
            return comm
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv]
    for role in ("broker", "worker"):
        if role in words:
            return role
    if "frontend" in words or any("gunicorn" in w for w in words):
        master = len(harness.process_tree(pid)) > 1
        return f"frontend (gunicorn {'master' if master else 'worker'})"
    if "up" in words:
        return "supervisor (llamapool up)"
    return " ".join(words)[:40]


def snapshot(pids: list[int]) -> dict[int, tuple[float, int, int]]:
    return {pid: (harness.cpu_seconds(pid), *_threads_switches(pid)) for pid in pids}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--threads", default="1", help="--threads for the workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots-per-worker", type=int, default=1,
                        help="each worker's batched slots (up's "
                             "--slots-per-worker; its shape on AMX: "
                             "--workers 1 --slots-per-worker 2 --threads 2)")
    parser.add_argument("--floor", action="store_true",
                        help="measure tests/bench/floor_pool.py instead (the "
                             "pool's processes and hops, none of its code)")
    parser.add_argument("--direct", action="store_true",
                        help="with --floor: workers send frames to the frontend, "
                             "not through the broker")
    parser.add_argument("--checkout", default=None, metavar="DIR",
                        help="measure the llamapool of another checkout (a "
                             "before/after: run this with and without it, "
                             "alternately)")
    args = parser.parse_args(argv)
    model = args.model or harness.default_model()
    if args.floor:
        threads = int(args.threads) if args.threads.isdigit() else os.cpu_count() or 1
        server, url = harness.floor_pool(model, args.workers, threads=threads,
                                         direct=args.direct)
        what = (f"the floor pool ({args.workers} workers × {threads} threads"
                f"{', frames straight to the frontend' if args.direct else ''})")
    else:
        server, url = harness.llamapool_up(model, workers=args.workers,
                                           threads=args.threads, checkout=args.checkout,
                                           slots_per_worker=args.slots_per_worker)
        what = f"up --workers {args.workers} --threads {args.threads}"
        if args.slots_per_worker != 1:
            what += f" --slots-per-worker {args.slots_per_worker}"
        if args.checkout:
            what += f" at {harness.checkout_commit(args.checkout)}"
    try:
        harness.run_load(url, concurrency=args.concurrency, requests=4,
                         duration_s=None, max_tokens=8, prompt=PROMPT,
                         ignore_eos=True)  # warm-up: every process has run once
        pids = harness.process_tree(server.pid)
        me = os.getpid()
        roles = {pid: _role(pid) for pid in pids}
        roles[me] = "client (llamapool bench, this process)"
        before = snapshot([*pids, me])
        wall = time.perf_counter()
        report = harness.run_load(
            url, concurrency=args.concurrency, requests=None,
            duration_s=args.duration, max_tokens=args.tokens, prompt=PROMPT,
            ignore_eos=True)
        wall = time.perf_counter() - wall
        after = snapshot([*pids, me])
    finally:
        server.stop()
    tokens = report["output_tokens"]
    rows = []
    totals = [0.0, 0, 0]
    for pid in [*pids, me]:
        cpu0, vol0, inv0 = before[pid]
        cpu1, vol1, inv1 = after[pid]
        d = (cpu1 - cpu0, vol1 - vol0, inv1 - inv0)
        totals = [t + x for t, x in zip(totals, d)]
        rows.append([roles[pid], pid, d[0] / tokens * 1e6, d[1] / tokens, d[2] / tokens,
                     d[0] / wall])
    rows.append(["all", "-", totals[0] / tokens * 1e6, totals[1] / tokens,
                 totals[2] / tokens, totals[0] / wall])
    print(f"## CPU per generated token ({os.path.basename(model)}, {what}, "
          f"concurrency {args.concurrency}, "
          f"{args.tokens} tokens, {args.duration:.0f} s, {tokens} tokens, "
          f"{report['output_tokens_per_s']:.1f} tokens/s, "
          f"threads alive here: {threading.active_count()})\n")
    print(harness.md_table(
        ["process", "pid", "CPU µs / token", "voluntary switches / token",
         "involuntary switches / token", "cores used"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
