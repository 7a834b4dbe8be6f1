"""Where the CPU goes for the same tokens, the pool against llama-server,
counted by ``perf`` across the whole machine.

    make bench-cpu-split   # or: python -m tests.bench.bench_cpu_split

Both servers are up at once. Each round sends the same load to each in
turn: ``--requests`` streamed requests of ``--tokens`` each, with
``ignore_eos``, at ``--concurrency``. During each load, ``perf record -a -e
cpu-clock`` samples every CPU at ``--frequency`` Hz. The samples of each
load are then split by process and by library:

* ggml's CPU kernels (``libggml-cpu``): the model's compute;
* OpenMP (``libgomp``): its barriers, where the compute threads spin;
* ``libllama``: sampling, graph building, the KV cache;
* Python (the interpreter and its extension modules), ZeroMQ (its library
  in the callers' threads, and its I/O threads), the kernel, anything else;
* all of it within the server's processes, the client (this process), and
  other processes.

Each count is given as CPU milliseconds per generated token.

Why count this way and not only time the rounds: on a shared VM, the same
tokens can take 14% more CPU time from one measurement to the next
(benchmarks section 30), which hides a difference of a few percent in
tokens/s. The split by library still shows what the pool spends outside
llama.cpp, next to what llama-server spends there.

It needs ``perf`` (Debian: ``linux-perf``) and the rights for ``-a``
(root, or ``kernel.perf_event_paranoid`` ≤ 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict

from llamapool.pool_shape import pool_shape
from tests.bench import harness
from tests.bench.bench_shapes import LLAMA_SERVER, NO_REPACK
from tests.pool import wait_until

PROMPT = "Write a short story about a llama who learns to fly."

#: The library groups, in the order of the report (first match wins), by
#: the library's file name: its path will not do, since every library of
#: the pool's virtualenv (ggml's, ZeroMQ's) lies under ``.../python3.11/``.
LIBRARIES = (
    ("ggml kernels", re.compile(r"^libggml-cpu")),
    ("OpenMP", re.compile(r"^libgomp")),
    ("libllama", re.compile(r"^libllama")),
    ("Python", re.compile(r"^libpython|\.cpython-|^libffi")),
    ("ZeroMQ", re.compile(r"^libzmq")),
    ("kernel", re.compile(r"^\[kernel")),
)
OTHER = "other"
ZMQ_IO = "ZeroMQ I/O threads"
COLUMNS = (*(name for name, _ in LIBRARIES), ZMQ_IO, OTHER)

#: A ``perf script -F pid,tid,comm,ip,dso`` line (a thread's name may hold
#: spaces): "  ZMQbg/IO/0 5678/5690  7f3c1a2b3c4d (/usr/lib/libzmq.so.5)".
_SAMPLE = re.compile(r"^\s*(.*?)\s+(\d+)/\d+\s+[0-9a-f]+\s+\((.*)\)\s*$")


def _group(comm: str, dso: str) -> str:
    if comm.startswith("ZMQbg"):
        return ZMQ_IO
    library = os.path.basename(dso)
    for name, pattern in LIBRARIES:
        if pattern.search(library):
            return name
    return OTHER


def perf_samples(path: str) -> list[tuple[int, int, str, str]]:
    """(samples, process id, thread name, library) from a ``perf.data``:
    ``perf script``, since ``perf report``'s pid key is the thread's."""
    out = subprocess.run(
        ["perf", "script", "-i", path, "-F", "pid,tid,comm,ip,dso"],
        capture_output=True, text=True, check=True).stdout
    counts: dict[tuple[int, str, str], int] = defaultdict(int)
    for line in out.splitlines():
        match = _SAMPLE.match(line)
        if match:
            comm, pid, dso = match.groups()
            counts[int(pid), comm, dso] += 1
    return [(n, pid, comm, dso) for (pid, comm, dso), n in counts.items()]


def split(rows, server_pids: set[int], client_pid: int) -> dict[str, dict[str, int]]:
    """Samples by owner (server, client, other) and library group; the idle
    task (pid 0) is left out."""
    owners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for samples, pid, comm, dso in rows:
        if pid == 0:
            continue
        owner = ("server" if pid in server_pids else
                 "client" if pid == client_pid else "other processes")
        owners[owner][_group(comm, dso)] += samples
    return owners


def measure(url: str, server_pid: int, args, work: str) -> tuple[dict, dict]:
    """One load under ``perf record -a``: the load's report, and its
    samples split by owner and library."""
    path = os.path.join(work, "perf.data")
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-e", "cpu-clock", "-F", str(args.frequency),
         "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # perf writes its file's header once its counters are open on every
        # CPU: the load starts after that, so its first tokens are counted.
        wait_until(lambda: perf.poll() is not None or (
            os.path.exists(path) and os.path.getsize(path) > 0),
            30, "perf record to start", interval_s=0.05)
        started = perf.poll() is None
        if started:
            report = harness.run_load(
                url, concurrency=args.concurrency, requests=args.requests,
                duration_s=None, max_tokens=args.tokens, prompt=PROMPT,
                ignore_eos=True)
    finally:
        perf.send_signal(signal.SIGINT)
        _, err = perf.communicate(timeout=60)
    if not started or perf.returncode not in (0, -signal.SIGINT):
        raise SystemExit(f"perf record failed ({perf.returncode}): {err.decode()[-400:]}")
    pids = set(harness.process_tree(server_pid))
    return report, split(perf_samples(path), pids, os.getpid())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20,
                        help="requests per server per round")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frequency", type=int, default=999,
                        help="perf's samples per second per CPU")
    shape = pool_shape(None, None)
    parser.add_argument("--workers", type=int, default=shape.workers)
    parser.add_argument("--slots-per-worker", type=int, default=shape.slots_per_worker)
    parser.add_argument("--threads", default=None,
                        help="the workers' --threads (default: up's own)")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        print("bench-cpu-split needs perf (Debian: apt install linux-perf)",
              file=sys.stderr)
        return 2
    model = harness.model_path(args.model)
    pool = (f"llamapool up --workers {args.workers} --slots-per-worker "
            f"{args.slots_per_worker}"
            + (f" --threads {args.threads}" if args.threads else ""))
    starts = {
        pool: lambda: harness.llamapool_up(model, workers=args.workers,
                                           threads=args.threads,
                                           slots_per_worker=args.slots_per_worker),
        LLAMA_SERVER: lambda: harness.llama_server(model, slots=2, n_threads=2,
                                                   extra=NO_REPACK),
    }
    per_token: dict[str, list[dict[str, float]]] = {name: [] for name in starts}
    speeds: dict[str, list[float]] = {name: [] for name in starts}
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        servers = {}
        for name, start in starts.items():
            server, url = start()
            stack.callback(server.stop)
            servers[name] = (server, url)
        for _, url in servers.values():
            harness.warm_up(url, args.concurrency, PROMPT)
        for round_no in range(args.rounds):
            order = list(servers) if round_no % 2 == 0 else list(servers)[::-1]
            for name in order:
                server, url = servers[name]
                report, owners = measure(url, server.pid, args, work)
                tokens = report["output_tokens"]
                ms = 1000.0 / args.frequency / tokens
                row = {f"server: {g}": owners["server"][g] * ms for g in COLUMNS}
                row["client"] = sum(owners["client"].values()) * ms
                row["other processes"] = sum(owners["other processes"].values()) * ms
                per_token[name].append(row)
                speeds[name].append(report["output_tokens_per_s"])
                print(f"round {round_no + 1}: {name}: "
                      f"{report['output_tokens_per_s']:.1f} tokens/s, {tokens} tokens",
                      flush=True)
    keys = list(per_token[pool][0])
    medians = {name: {k: harness.median([r[k] for r in rows]) for k in keys}
               for name, rows in per_token.items()}
    table = [[k, medians[pool][k], medians[LLAMA_SERVER][k],
              medians[pool][k] - medians[LLAMA_SERVER][k]] for k in keys]
    outside = [f"server: {g}" for g in COLUMNS if g not in ("ggml kernels", "OpenMP")]
    table.append(["server, outside ggml and OpenMP",
                  *(sum(medians[n][k] for k in outside) for n in (pool, LLAMA_SERVER)),
                  sum(medians[pool][k] - medians[LLAMA_SERVER][k] for k in outside)])
    table.append(["tokens/s", harness.median(speeds[pool]),
                  harness.median(speeds[LLAMA_SERVER]),
                  harness.ratio(harness.median(speeds[pool]),
                                harness.median(speeds[LLAMA_SERVER]))])
    print(f"\n## CPU ms per generated token, by process and library, median of "
          f"{args.rounds} rounds ({os.path.basename(model)}, {harness.cpu_name()}, "
          f"concurrency {args.concurrency}, {args.requests} × {args.tokens} tokens, "
          f"perf -a at {args.frequency} Hz)\n")
    print(harness.md_table(["CPU ms / token", pool, LLAMA_SERVER,
                            "difference (tokens/s: ratio)"], table))
    ratios = [a / b for a, b in zip(speeds[pool], speeds[LLAMA_SERVER], strict=True)]
    print(f"\ntokens/s, the pool / llama-server, by round: "
          f"{' '.join(f'{r:.2f}' for r in ratios)} (median {harness.median(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
