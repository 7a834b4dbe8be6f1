"""What the benchmark scripts share: starting servers, timing loops, tables.

The benchmarks are scripts (``make bench-<name>``), not tests: pytest never
collects ``tests/bench/bench_*.py``. Every server they measure is a real
process started as a user starts it, and stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llamapool import loadgen
from protocol.payloads import Sampling
from tests.pool import free_port, wait_until
from workers.model.settings import WorkerSettings

STOP_TIMEOUT_S = 40.0


#: The workers' default ``--flash-attn``: the in-process loops run as the
#: pool does unless a benchmark asks otherwise.
POOL_FLASH_ATTN = WorkerSettings.flash_attn == "on"


def rounds_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The flags every interleaved-rounds benchmark takes: the model, tokens
    per request, seconds per target and level in a round, and rounds."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds per target, level and round")
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table; floats get a sensible number of digits."""

    def cell(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if value == 0 or abs(value) >= 100:
                return f"{value:.0f}"
            if abs(value) >= 10:
                return f"{value:.1f}"
            return f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_name() -> str:
    """This CPU's model name, core count and whether it has AMX, for a
    benchmark's title (which CPU a figure comes from matters here)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), "unknown CPU")
    return f"{name}, {os.cpu_count()} cores, AMX: {'yes' if 'amx_tile' in text else 'no'}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def median(values: list[float]) -> float | None:
    return loadgen.percentile(values, 50)


def default_model() -> str:
    from llamapool.supervisor import default_model_path

    return default_model_path()


def model_path(arg: str | None) -> str:
    """A benchmark's ``--model``: a GGUF path, ``tiny`` for the test model
    (written to a temporary directory), or None for the default model."""
    if arg == "tiny":
        return tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")))
    return arg or default_model()


def tiny_model(directory: Path) -> str:
    from llamapool.test_model import write_test_model

    path = directory / "tiny.gguf"
    if not path.exists():
        write_test_model(path)
    return str(path)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # gone
    # fields[11], fields[12] are utime, stime (stat fields 14 and 15).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (e.g. gunicorn's workers)."""
    pids = [pid]
    for p in pids:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pids += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return pids


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live descendants."""
    return sum(cpu_seconds(p) for p in process_tree(pid))


class Server:
    """One server process (its own session), its log in a temp file."""

    def __init__(self, name: str, argv: list[str], ready_url: str | None = None,
                 env: dict | None = None, ready_timeout_s: float = 180,
                 cwd: str | None = None) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                      env=env, cwd=cwd, start_new_session=True)

        if ready_url is None:
            return  # the caller knows when it is ready

        def ready() -> bool:
            self.check_alive()
            return http_ok(ready_url)

        try:
            wait_until(ready, ready_timeout_s, f"{name} to answer {ready_url}",
                       interval_s=0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited early; log: {self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.log.closed:
            return  # stopped already (an early stop, then the exit stack's)
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def llamapool_up(model: str, workers: int, threads: int | str | None, *, ctx: int = 2048,
                 extra: tuple[str, ...] = (), env: dict | None = None,
                 checkout: str | None = None,
                 slots_per_worker: int = 1) -> tuple[Server, str]:
    """``llamapool up`` on a free port; returns the server and its base URL.
    ``threads``: the workers' ``--threads``; None: ``up``'s own default.
    ``slots_per_worker``: each worker's batched slots (``--slots-per-worker``).
    ``env``: the whole environment of the pool's processes (default: ours).
    ``checkout``: run the llamapool code of that directory (another commit
    checked out beside this one, for a before/after side by side) instead
    of this one; it is every process's working directory and first on its
    ``PYTHONPATH``, ahead of the installed package."""
    if checkout is not None:
        env = dict(env or os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.abspath(checkout), env.get("PYTHONPATH")) if p)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "llamapool", "--log-level", "warning", "up",
            "--model", model, "--workers", str(workers),
            "--ctx", str(ctx), "--port", str(port), *extra]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if slots_per_worker != 1:
        argv += ["--slots-per-worker", str(slots_per_worker)]
    server = Server("llamapool-up", argv, url + "/health", env=env, cwd=checkout)
    # /health is ok with one slot; wait for all of them.
    slots = workers * slots_per_worker
    wait_until(lambda: _idle_slots(url) == slots, 180, f"{slots} idle slots",
               interval_s=0.2)
    return server, url


def checkout_commit(checkout: str) -> str:
    """The short commit a checkout is at, for a benchmark's title."""
    return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _idle_slots(url: str) -> int:
    import json

    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return json.loads(resp.read()).get("slots_idle", 0)
    except OSError:
        return 0


def slot_pids(url: str) -> list[int]:
    """Worker pids from ``/slots`` (open pool, no key)."""
    import json

    with urllib.request.urlopen(url + "/slots", timeout=5) as resp:
        return [s["pid"] for s in json.loads(resp.read())]


def llama_cpp_server(model: str, n_threads: int, *, ctx: int = 2048,
                     extra: tuple[str, ...] = ()) -> tuple[Server, str]:
    """llama-cpp-python's own OpenAI server on a free port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(ctx),
            "--n_threads", str(n_threads), "--n_threads_batch", str(n_threads),
            *extra]
    return Server("llama-cpp-server", argv, url + "/v1/models"), url


def llama_server(model: str, slots: int, n_threads: int, *, ctx: int = 2048,
                 extra: tuple[str, ...] = ()) -> tuple[Server, str]:
    """llama.cpp's ``llama-server`` (built from the workers' own llama.cpp,
    ``tests.bench.llama_server``) on a free port."""
    from tests.bench import llama_server as build

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = build.argv(model, slots=slots, n_threads=n_threads, port=port, ctx=ctx)
    return Server("llama-server", [*argv, *extra], url + "/health"), url


def floor_pool(model: str, workers: int = 2, *, threads: int = 1,
               direct: bool = False) -> tuple[Server, str]:
    """``tests.bench.floor_pool``: llamapool's processes and hops, no work;
    ``direct``: frames that skip the broker."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tests.bench.floor_pool", "--model", model,
            "--port", str(port), "--workers", str(workers), "--threads", str(threads),
            *(("--direct",) if direct else ())]
    return Server("floor-pool", argv, url + "/health"), url


def run_load(url: str, **config) -> dict:
    """One ``llamapool bench`` run in this process; returns its report."""
    return loadgen.run_bench(loadgen.BenchConfig(base_url=url, **config))


def warm_up(url: str, concurrency: int, prompt: str) -> None:
    """A few short requests before a measurement: a server's first ones
    prefill the prompt cold and touch memory for the first time (a fresh
    pool's first two at concurrency 2 took 218 and 229 ms to their first
    token, the rest 60-78), and would otherwise be its TTFT p99."""
    run_load(url, concurrency=concurrency, requests=2 * concurrency, max_tokens=4,
             prompt=prompt, ignore_eos=True, wait_after_503_s=0.05)


def start_warm(stack: contextlib.ExitStack, starts: dict, *, concurrency: int,
               prompt: str) -> dict[str, str]:
    """Start every server of ``starts`` (name -> a ``llamapool_up``-like
    function), each stopped when ``stack`` closes, all up before any is
    warmed up (``warm_up``); returns name -> base URL."""
    urls = {}
    for name, start in starts.items():
        server, urls[name] = start()
        stack.callback(server.stop)
    for url in urls.values():
        warm_up(url, concurrency, prompt)
    return urls


def run_load_ttfts(url: str, **config) -> tuple[dict, list[float]]:
    """``run_load``, and every completed request's time to first token (s),
    for percentiles over several runs."""
    bench = loadgen.BenchConfig(base_url=url, **config)
    results, wall_s = loadgen.run_requests(bench)
    return (loadgen.summarize(bench, results, wall_s),
            [r.ttft_s for r in results if r.ok and r.ttft_s is not None])


def interleaved_rounds(urls: dict[str, str], groups: list[list[tuple[str, int]]],
                       args, prompt: str, **load) -> tuple[dict, dict]:
    """Run every (target, concurrency) of ``groups`` for ``args.duration``
    seconds, ``args.rounds`` times; each round starts one group later, so
    the machine's drift falls on every target alike. ``args``: a
    ``rounds_parser``'s. Returns the tokens/s per run and round, and every
    request's time to first token per run."""
    rates = {run: [] for group in groups for run in group}
    ttfts = {run: [] for group in groups for run in group}
    for r in range(args.rounds):
        for group in groups[r % len(groups):] + groups[:r % len(groups)]:
            for name, c in group:
                report, ttft_s = run_load_ttfts(
                    urls[name], concurrency=c, requests=None, duration_s=args.duration,
                    max_tokens=args.tokens, prompt=prompt, ignore_eos=True, **load)
                rates[name, c].append(report["output_tokens_per_s"])
                ttfts[name, c] += ttft_s
        print(f"round {r + 1} done", flush=True)
    return rates, ttfts


# --- in-process generation -----------------------------------------------------


@dataclasses.dataclass
class LoopTiming:
    ttft_s: float
    total_s: float
    tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first."""
        decode_s = self.total_s - self.ttft_s
        return (self.tokens - 1) / decode_s if decode_s > 0 else 0.0


_DEFAULTS = Sampling()
#: The pool's sampling defaults (``protocol.payloads.Sampling``) as
#: ``Llama.generate`` keywords, so in-process loops do the same work.
SAMPLING = {"temp": _DEFAULTS.temperature, "top_k": _DEFAULTS.top_k,
            "top_p": _DEFAULTS.top_p, "min_p": _DEFAULTS.min_p,
            "repeat_penalty": _DEFAULTS.repeat_penalty}


def load_llama(model: str, n_threads: int, n_ctx: int = 2048, *,
               flash_attn: bool = POOL_FLASH_ATTN):
    """The model as the worker loads it (``EngineLlama``: a ``LogitBiasLlama``,
    for ``ban_eog``, with this CPU's ``--repack auto``; llama.cpp's default
    repacking crashes on AMX)."""
    from workers.model.llama_internals import EngineLlama

    return EngineLlama(model_path=model, n_ctx=n_ctx, n_threads=n_threads,
                       n_threads_batch=n_threads, flash_attn=flash_attn,
                       verbose=False)


def ban_eog(llama, *, in_python: bool = False):
    """Ban end-of-generation tokens (ignore_eos) in ``llama``'s later
    ``generate`` calls, as the worker does: with llama.cpp's logit-bias
    sampler (``workers.model.native_bias``). Returns the logits processors to
    pass to ``generate``: none then; with ``in_python``, llama-cpp-python's
    own way, a Python processor on the whole vocabulary per token."""
    import llama_cpp

    vocab = llama._model.vocab
    eog = [t for t in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    if not in_python:
        llama.logit_bias = dict.fromkeys(eog, -float("inf"))
        return None

    def processor(input_ids, scores):
        scores[eog] = -float("inf")
        return scores

    return llama_cpp.LogitsProcessorList([processor])


def generate_loop(llama, prompt: str, n_tokens: int, processors) -> LoopTiming:
    """A bare ``Llama.generate`` loop, prefix reuse as the worker does it."""
    from workers.model import kv_cache
    from workers.model.kv_sequence import LlamaSequence

    tokens = llama.tokenize(prompt.encode("utf-8"), special=True)
    started = time.perf_counter()
    plan = kv_cache.plan_reuse(LlamaSequence(llama), tokens)
    first = None
    n = 0
    gen = llama.generate(plan.tokens, reset=plan.reset, logits_processor=processors,
                         **SAMPLING)
    try:
        for _token in gen:
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= n_tokens:
                break
    finally:
        gen.close()
    ended = time.perf_counter()
    return LoopTiming(ttft_s=(first or ended) - started, total_s=ended - started,
                      tokens=n)


_CLIENTS: dict = {}


def stream_once(url: str, prompt: str, max_tokens: int) -> LoopTiming:
    """One streamed completion over HTTP, timed like ``generate_loop``, by
    ``llamapool bench``'s client. It keeps its connection open, as real
    clients do: a new connection per request cost ~20 ms here, which is the
    client's cost, not the server's TTFT."""
    key = (url, prompt, max_tokens)
    if key not in _CLIENTS:
        _CLIENTS[key] = loadgen.Client(loadgen.BenchConfig(
            base_url=url, max_tokens=max_tokens, prompt=prompt, ignore_eos=True))
    result = _CLIENTS[key].one_request()
    if not result.ok:
        raise RuntimeError(f"stream failed: {result.status} {result.error}")
    return LoopTiming(ttft_s=result.ttft_s or result.latency_s,
                      total_s=result.latency_s, tokens=result.output_tokens)


def _generate_in_child(model: str, n_threads: int, prompt: str, n_tokens: int,
                       reps: int, flash_attn: bool, barrier, results) -> None:
    llama = load_llama(model, n_threads, flash_attn=flash_attn)
    processors = ban_eog(llama)
    generate_loop(llama, prompt, 4, processors)  # warm-up
    barrier.wait()
    started = time.perf_counter()
    tokens = sum(generate_loop(llama, prompt, n_tokens, processors).tokens
                 for _ in range(reps))
    results.put((tokens, reps, time.perf_counter() - started))


def in_child(target, *args):
    """``target(*args, results)`` in a spawned process (its own llama.cpp
    threads, none of ours); returns what it put in ``results``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
    child.start()
    outcome = results.get(timeout=3600)
    child.join()
    return outcome


def batched_engine_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a benchmark of the batched engine in process: the
    model, its slots, threads and flash attention."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flash-attn", choices=("on", "off"),
                        default="on" if POOL_FLASH_ATTN else "off")
    return parser


def parallel_generate(model: str, processes: int, n_threads: int, prompt: str,
                      n_tokens: int, reps: int, *,
                      flash_attn: bool = POOL_FLASH_ATTN) -> dict:
    """The ceiling: ``processes`` in-process generate loops side by side.

    Returns requests/s and tokens/s over the slowest process's wall time.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [ctx.Process(target=_generate_in_child,
                         args=(model, n_threads, prompt, n_tokens, reps,
                               flash_attn, barrier, results))
             for _ in range(processes)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    wall_s = max(seconds for _, _, seconds in outcomes)
    return {"requests_per_s": sum(r for _, r, _ in outcomes) / wall_s,
            "output_tokens_per_s": sum(t for t, _, _ in outcomes) / wall_s}
