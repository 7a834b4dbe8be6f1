"""What one broker and one frontend host can carry, with no model in the way.

    make bench-broker   # or: python -m tests.bench.bench_broker

1. Frames/s one broker relays: synthetic workers emitting as fast as they can
   (``--engine synthetic`` at a very high tokens/s) through the real broker to
   a client speaking the wire protocol (credit included), vs a bare pyzmq
   ROUTER-to-ROUTER relay loop fed by producers that send the same TOKEN
   frames. Also the relay process's CPU time per frame, which the producers'
   and client's own costs do not blur; a relay CPU share well under 1.0
   means the relay was not the bottleneck (the producers or the client were).
2. Requests/s for 8-token completions at concurrency 64 through one frontend
   host (``llamapool frontend``: gunicorn, processes × threads reported),
   driven by ``llamapool bench``.
3. 503 rejections/s when saturated: every slot held by a client that stopped
   reading (its worker pauses on credit), then the same load.

All numbers come from one run on one machine; the load generator shares it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
import uuid

import msgpack
import zmq

from protocol import messages
from protocol.payloads import GenerationRequest
from tests.bench import harness
from tests.pool import BrokerProbe, free_port, wait_until

#: Frames the client consumes before it returns credit (as the frontend does).
CREDIT_BATCH_FRAMES = 64
FAST_TOKENS_PER_S = 1_000_000.0
#: Context for synthetic workers: room for effectively endless jobs.
HUGE_CTX = 1 << 30


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llamapool", "--log-level", "warning", *args]


def start_broker(run_dir: str) -> tuple[harness.Server, str, str]:
    front, back = f"ipc://{run_dir}/frontends", f"ipc://{run_dir}/workers"
    return harness.Server("broker", cli("broker", "--frontends", front,
                                        "--workers", back)), front, back


def start_workers(n: int, workers_ep: str, tokens_per_s: float) -> list[harness.Server]:
    return [harness.Server(f"worker{i}", cli(
        "worker", "--broker", workers_ep, "--engine", "synthetic",
        "--tokens-per-second", str(tokens_per_s), "--ctx", str(HUGE_CTX)))
        for i in range(n)]


def wait_slots(front: str, n: int, timeout_s: float = 120) -> None:
    probe = BrokerProbe(front)
    try:
        def ready():
            snap = probe.status(timeout_s=1.0)
            return snap and snap["slots_total"] == n and snap["slots_free"] == n
        wait_until(ready, timeout_s, f"{n} free slots", interval_s=0.1)
    finally:
        probe.close()


def stop_all(servers: list[harness.Server]) -> None:
    for server in servers:
        server.stop()


# --- 1. frames/s -----------------------------------------------------------------


def count_token_frames(sock: zmq.Socket, duration_s: float) -> tuple[int, float]:
    """Read TOKEN frames for ``duration_s`` after the first; return count, secs.

    Credit goes back every ``CREDIT_BATCH_FRAMES`` frames per job, as the
    frontend does, so a broker-fed worker never pauses for lack of it.
    """
    unacked: dict[str, int] = {}
    count = 0
    started = None
    while True:
        if not sock.poll(10_000):
            raise RuntimeError("no frames for 10 s")
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = messages.decode(frames)
            if not isinstance(msg, messages.Token):
                continue
            if started is None:
                started = time.perf_counter()
            count += 1
            n = unacked.get(msg.job_id, 0) + 1
            if n >= CREDIT_BATCH_FRAMES:
                sock.send_multipart(messages.Credit(msg.job_id, n).to_wire())
                n = 0
            unacked[msg.job_id] = n
        if started is None:
            continue
        elapsed = time.perf_counter() - started
        if elapsed >= duration_s:
            return count, elapsed


def broker_frames(n_workers: int, duration_s: float) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        broker, front, back = start_broker(run_dir)
        workers = start_workers(n_workers, back, FAST_TOKENS_PER_S)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            wait_slots(front, n_workers)
            sock.connect(front)
            sock.send_multipart(messages.Hello(os.getpid(), socket.gethostname())
                                .to_wire())
            for _ in range(n_workers):
                request = GenerationRequest("completion", "x",
                                            max_tokens=HUGE_CTX // 2)
                sock.send_multipart(messages.Submit(uuid.uuid4().hex, request)
                                    .to_wire())
            cpu_before = harness.cpu_seconds(broker.pid)
            count, elapsed = count_token_frames(sock, duration_s)
            cpu = harness.cpu_seconds(broker.pid) - cpu_before
        finally:
            sock.close()
            ctx.term()
            stop_all(workers + [broker])
    return {"frames_per_s": count / elapsed, "cpu_us_per_frame": cpu / count * 1e6,
            "relay_cpu_share": cpu / elapsed}


def _bare_relay(front_ep: str, back_ep: str) -> None:
    """ROUTER (client side) <- ROUTER (producer side), nothing else."""
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    back = ctx.socket(zmq.ROUTER)
    # Block instead of dropping when the client lags (back-pressure to the
    # producers), like the broker, which never drops either.
    front.setsockopt(zmq.ROUTER_MANDATORY, 1)
    front.bind(front_ep)
    back.bind(back_ep)
    client = front.recv_multipart()[0]  # the client says hello first
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(1000))
        if back in ready:
            for _ in range(256):
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                frames[0] = client
                try:
                    front.send_multipart(frames)
                except zmq.ZMQError:
                    return  # the client has gone: the measurement is over
        if front in ready:
            for _ in range(256):
                try:
                    front.recv_multipart(zmq.NOBLOCK)  # credit: nobody needs it
                except zmq.Again:
                    break


def _bare_producer(back_ep: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(back_ep)
    job_id = uuid.uuid4().hex
    i = 0
    while True:
        text = f" tok{i}"
        sock.send_multipart([messages.PROTOCOL_HEADER, messages.Token.COMMAND,
                             msgpack.packb([job_id, text, 1])])
        i += 1


def bare_relay_frames(n_producers: int, duration_s: float) -> dict:
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as run_dir:
        front, back = f"ipc://{run_dir}/front", f"ipc://{run_dir}/back"
        relay = spawn.Process(target=_bare_relay, args=(front, back), daemon=True)
        relay.start()
        producers = [spawn.Process(target=_bare_producer, args=(back,), daemon=True)
                     for _ in range(n_producers)]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(front)
            sock.send_multipart(messages.Hello(os.getpid(), "bench").to_wire())
            for p in producers:
                p.start()
            cpu_before = harness.cpu_seconds(relay.pid)
            count, elapsed = count_token_frames(sock, duration_s)
            cpu = harness.cpu_seconds(relay.pid) - cpu_before
        finally:
            sock.close()
            ctx.term()
            for p in [*producers, relay]:
                p.terminate()
                p.join(timeout=10)
    return {"frames_per_s": count / elapsed, "cpu_us_per_frame": cpu / count * 1e6,
            "relay_cpu_share": cpu / elapsed}


# --- 2 and 3. through one frontend host --------------------------------------------


class HeldStream:
    """A streamed request whose client reads the headers and then stops."""

    def __init__(self, port: int) -> None:
        body = (b'{"prompt": "x", "max_tokens": 100000000, "stream": true}')
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("the server closed a held stream")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"a held stream got {head.splitlines()[0]!r}")

    def close(self) -> None:
        self.sock.close()


def frontend_host(n_workers: int, concurrency: int, duration_s: float,
                  worker_tokens_per_s: float) -> dict:
    processes = os.environ.get("LLAMAPOOL_FRONTEND_PROCESSES", "2")
    threads = os.environ.get("LLAMAPOOL_FRONTEND_THREADS", "64")
    out: dict = {"gunicorn": f"{processes} processes × {threads} threads"}
    with tempfile.TemporaryDirectory() as run_dir:
        broker, front, back = start_broker(run_dir)
        workers = start_workers(n_workers, back, worker_tokens_per_s)
        servers = [*workers, broker]
        try:
            wait_slots(front, n_workers)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            frontend = harness.Server("frontend", cli(
                "frontend", "--broker", front, "--bind", f"127.0.0.1:{port}"),
                url + "/health")
            servers.insert(0, frontend)
            harness.run_load(url, concurrency=concurrency, requests=concurrency,
                             max_tokens=8)  # warm-up: every gunicorn thread
            cpu = {"frontend": harness.tree_cpu_seconds(frontend.pid),
                   "broker": harness.cpu_seconds(broker.pid),
                   "load generator": time.process_time()}
            out["completions"] = harness.run_load(
                url, concurrency=concurrency, requests=None, duration_s=duration_s,
                max_tokens=8)
            wall = out["completions"]["duration_s"]
            out["cpu_share"] = {
                "frontend": (harness.tree_cpu_seconds(frontend.pid)
                             - cpu["frontend"]) / wall,
                "broker": (harness.cpu_seconds(broker.pid) - cpu["broker"]) / wall,
                "load generator": (time.process_time() - cpu["load generator"])
                / wall,
            }
            held = [HeldStream(port) for _ in range(n_workers)]
            try:
                wait_until(lambda: harness.run_load(
                    url, concurrency=1, requests=1, max_tokens=8)
                    ["requests_rejected_503"] == 1, 30, "every slot to be held")
                out["saturated"] = harness.run_load(
                    url, concurrency=concurrency, requests=None,
                    duration_s=duration_s, max_tokens=8)
            finally:
                for stream in held:
                    stream.close()
        finally:
            stop_all(servers)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relay-workers", type=int, default=2,
                        help="synthetic workers / bare producers feeding the relay")
    parser.add_argument("--host-workers", type=int, default=64,
                        help="synthetic workers behind the frontend host")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds per measurement")
    parser.add_argument("--worker-tokens-per-second", type=float, default=2000.0,
                        help="synthetic rate for the completions (8 tokens each)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 s per measurement, 8 workers, "
                             "concurrency 8")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.host_workers, args.concurrency = 2.0, 8, 8

    broker = broker_frames(args.relay_workers, args.duration)
    bare = bare_relay_frames(args.relay_workers, args.duration)
    host = frontend_host(args.host_workers, args.concurrency, args.duration,
                         args.worker_tokens_per_second)

    print(f"## Broker relay ({args.relay_workers} producers, {args.duration:.0f} s, "
          f"{os.cpu_count()} cores)\n")
    print(harness.md_table(
        ["relay", "TOKEN frames/s", "relay CPU µs/frame", "relay CPU share"],
        [["llamapool broker (synthetic workers, credit)", broker["frames_per_s"],
          broker["cpu_us_per_frame"], broker["relay_cpu_share"]],
         ["bare pyzmq ROUTER-to-ROUTER loop", bare["frames_per_s"],
          bare["cpu_us_per_frame"], bare["relay_cpu_share"]],
         ["ratio broker / bare",
          harness.ratio(broker["frames_per_s"], bare["frames_per_s"]),
          harness.ratio(broker["cpu_us_per_frame"], bare["cpu_us_per_frame"]),
          None]],
    ))
    done, sat = host["completions"], host["saturated"]
    print(f"\n## One frontend host ({host['gunicorn']}, {args.host_workers} "
          f"synthetic workers at {args.worker_tokens_per_second:.0f} tokens/s, "
          f"concurrency {args.concurrency}, 8-token streamed completions)\n")
    print(harness.md_table(
        ["load", "completed req/s", "503/s", "failed", "TTFT p50 ms",
         "latency p50 ms", "latency p99 ms", "503 answer p50 ms"],
        [["free slots", done["requests_per_s"], done["rejections_per_s"],
          done["requests_failed"], done["ttft_ms"]["p50"], done["latency_ms"]["p50"],
          done["latency_ms"]["p99"], done["rejected_latency_ms"]["p50"]],
         ["every slot held (saturated)", sat["requests_per_s"],
          sat["rejections_per_s"], sat["requests_failed"], None, None, None,
          sat["rejected_latency_ms"]["p50"]]],
    ))
    share = ", ".join(f"{k} {v:.0%}" for k, v in host["cpu_share"].items())
    print(f"\nCPU while serving completions (share of one core): {share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
