"""What one thread hand-off costs on this machine, idle and with cores busy.

    make bench-handoff    # or: python -m tests.bench.bench_handoff [--busy 0 1 2]

The time to first token crosses five hand-offs between threads that the
design has: gunicorn's event loop to a request thread, request thread to
link thread and back, the worker's link thread to its main thread and back.
The segments of ``bench-ttft-hops`` that hold them take 0.14-0.27 ms each
(BENCHMARKS.md section 17). This asks how much of that is the hand-off
itself: one thread puts a
timestamp in a ``queue.Queue`` (as the pool's threads do), a second thread
blocked on ``get`` takes it, and the delay is recorded. The same for a
ZeroMQ ``ipc://`` PAIR between two processes, the pool's kind of hop.

``--busy N`` first starts N processes that spin on a core, as a decoding
worker (one llama.cpp thread) does during a request; on 2 cores, ``--busy
1`` is the pool at concurrency 1 and ``--busy 2`` at concurrency 2. Each
setting runs in turn, interleaved ``--repeat`` times, and the medians are
printed side by side.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import tempfile
import threading
import time

import zmq

from llamapool.loadgen import percentile
from tests.bench import harness

#: Between two hand-offs, so that each one finds its receiver asleep, as in
#: the pool (a request's hand-offs are milliseconds apart).
GAP_S = 0.002


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def thread_handoffs(rounds: int) -> list[float]:
    """Delays (µs) from ``put`` in one thread to ``get`` returning in another."""
    handoffs: queue.Queue[float | None] = queue.Queue()
    delays: list[float] = []

    def receiver():
        while (sent := handoffs.get()) is not None:
            delays.append((time.perf_counter() - sent) * 1e6)

    thread = threading.Thread(target=receiver)
    thread.start()
    for _ in range(rounds):
        time.sleep(GAP_S)
        handoffs.put(time.perf_counter())
    handoffs.put(None)
    thread.join()
    return delays


def _ipc_receiver(endpoint: str, rounds: int, results) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)
    sock.send(b"ready")
    delays = []
    for _ in range(rounds):
        sent = float(sock.recv())
        delays.append((time.time() - sent) * 1e6)
    results.put(delays)
    sock.close(0)
    ctx.term()


def ipc_hops(rounds: int) -> list[float]:
    """Delays (µs) from ``send`` in one process to ``recv`` returning in
    another, over a ZeroMQ ``ipc://`` PAIR (wall clock: both processes read
    the same one)."""
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/hop"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.bind(endpoint)
        results = multiprocessing.Queue()
        peer = multiprocessing.Process(target=_ipc_receiver,
                                       args=(endpoint, rounds, results))
        peer.start()
        sock.recv()  # the peer is connected
        for _ in range(rounds):
            time.sleep(GAP_S)
            sock.send(repr(time.time()).encode())
        delays = results.get()
        peer.join()
        sock.close(0)
        ctx.term()
    return delays


def run(busy: int, rounds: int) -> tuple[float, float, float, float]:
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,))
                for _ in range(busy)]
    for spinner in spinners:
        spinner.start()
    try:
        threads = thread_handoffs(rounds)
        hops = ipc_hops(rounds)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
    return (harness.median(threads), percentile(threads, 90),
            harness.median(hops), percentile(hops, 90))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=500,
                        help="hand-offs per setting and repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2],
                        help="spinning processes during each setting")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 50 hand-offs, once")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeat = 50, 1
    medians: dict[int, list[tuple[float, float, float, float]]] = {
        b: [] for b in args.busy}
    for _ in range(args.repeat):
        for busy in args.busy:
            medians[busy].append(run(busy, args.rounds))
    print(harness.md_table(
        ["cores kept busy", "thread hand-off, µs p50", "p90",
         "ZeroMQ ipc hop, µs p50", "p90"],
        [[busy, *(harness.median([r[i] for r in runs]) for i in range(4))]
         for busy, runs in medians.items()]))


if __name__ == "__main__":
    main()
