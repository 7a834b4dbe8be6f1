"""The floor: a pool with llamapool's shape and nothing else (issue 15).

    python -m tests.bench.floor_pool --model GGUF --port P   # bench-rounds starts it

Not llamapool, and not for use: a yardstick. It has the processes and the
ZeroMQ hops of ``llamapool up --workers 2 --threads 1`` (an HTTP frontend, a
ROUTER-to-ROUTER broker over ipc, two model processes each decoding with one
thread), and none of the rest: no heartbeats, no ledger beyond "which worker
is idle", no validation, no tokeniser at the frontend, no credit, no
metrics, no link threads. Each process has one thread of its own (libzmq
adds its I/O thread), so a token costs the fewest wake-ups any design with
these processes can: the worker sends its frame from the decoding thread,
the broker relays it, and the frontend's one thread writes it to the client.

What llamapool up reaches against this floor, side by side in the same round
(``make bench-rounds``), is what our own code costs; what the floor itself
loses against two bare in-process loops is what separate processes and
ZeroMQ cost on this machine, for any design.

``--direct`` is the other design issue 32 weighs: frames that skip the
broker. Each frontend binds a PULL socket of its own and names it in the
SUBMIT; the worker pushes the job's TOKEN and END frames straight to it and
tells the broker only that the slot is free (FREE). A token then wakes the
worker's and the frontend's I/O threads and the frontend, not the broker's
thread and its I/O thread twice more (``make bench-direct-frames``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import tempfile

import zmq

from tests.bench import harness
from workers.model import kv_cache
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.kv_sequence import LlamaSequence

#: Frames: (command, job id, payload). FREE: a direct worker's slot is free
#: (its END went to the frontend).
SUBMIT, TOKEN, END, FREE = b"S", b"T", b"E", b"F"


def name_process(name: str) -> None:
    """Show ``name`` as this process's comm (``make bench-cpu-per-token
    --floor`` tells the processes apart by it)."""
    with open("/proc/self/comm", "w") as f:
        f.write(name)


def worker_main(model: str, endpoint: str, loaded, n_threads: int = 1) -> None:
    """Decode with ``n_threads``; send each token's text from the decoding
    thread: to the broker, or (a SUBMIT that names a frames endpoint) to that
    frontend."""
    name_process("floor-worker")
    llama = harness.load_llama(model, n_threads)
    processors = harness.ban_eog(llama)
    harness.generate_loop(llama, "warm up", 4, processors)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"READY", b"", b""])
    loaded.release()
    pieces = IncrementalDetokenizer(llama._model.vocab)  # its piece() only
    to_frontend: dict[str, zmq.Socket] = {}
    while True:
        _, job_id, body = sock.recv_multipart()
        prompt, n_tokens, frames_ep = json.loads(body)
        if frames_ep and frames_ep not in to_frontend:
            to_frontend[frames_ep] = ctx.socket(zmq.PUSH)
            to_frontend[frames_ep].connect(frames_ep)
        out = to_frontend[frames_ep] if frames_ep else sock
        tokens = llama.tokenize(prompt.encode(), special=True)
        plan = kv_cache.plan_reuse(LlamaSequence(llama), tokens)  # reuse as the worker does
        gen = llama.generate(plan.tokens, reset=plan.reset,
                             logits_processor=processors, **harness.SAMPLING)
        n = 0
        try:
            for token in gen:
                n += 1
                out.send_multipart([TOKEN, job_id, pieces.piece(token)])
                if n >= n_tokens:
                    break
        finally:
            gen.close()
        if out is not sock:
            # Before the END: the client's next request, which the END sets
            # off, must find the slot free (the broker queues it if not).
            sock.send_multipart([FREE, job_id, b""])
        out.send_multipart([END, job_id, str(n).encode()])


def broker_main(frontend_ep: str, worker_ep: str) -> None:
    """Relay: SUBMIT to an idle worker, its frames back to the frontend."""
    name_process("floor-broker")
    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind(frontend_ep)
    back.bind(worker_ep)
    idle: list[bytes] = []
    owner: dict[bytes, bytes] = {}
    # A direct worker's FREE and its frontend's next SUBMIT travel different
    # pipes: a SUBMIT that finds no idle worker waits for the next one.
    waiting: list[tuple[bytes, bytes, bytes]] = []

    def submit(peer: bytes, job_id: bytes, body: bytes) -> None:
        owner[job_id] = peer
        back.send_multipart([idle.pop(0), SUBMIT, job_id, body])

    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is back:
                worker, command, job_id, body = back.recv_multipart()
                if command not in (b"READY", FREE):
                    front.send_multipart([owner[job_id], command, job_id, body])
                if command != TOKEN:
                    owner.pop(job_id, None)
                    idle.append(worker)
                    if waiting:
                        submit(*waiting.pop(0))
            else:
                peer, command, job_id, body = front.recv_multipart()
                if idle:
                    submit(peer, job_id, body)
                else:  # the load never asks for more than the slots
                    waiting.append((peer, job_id, body))


class Conn:
    """One client connection at the frontend."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""


def sse(event: dict) -> bytes:
    data = b"data: " + json.dumps(event).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


HEADERS = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n")
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def frontend_main(port: int, broker_ep: str, frames_ep: str = "") -> None:
    """HTTP in, SUBMIT out, frames to SSE chunks: one thread, one poller.
    ``frames_ep``: bind it and have workers send frames there directly."""
    name_process("floor-frontend")
    listener = socket.create_server(("127.0.0.1", port))
    listener.setblocking(False)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(broker_ep)
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    frames = None
    if frames_ep:
        frames = ctx.socket(zmq.PULL)
        frames.bind(frames_ep)
        poller.register(frames, zmq.POLLIN)
    poller.register(listener.fileno(), zmq.POLLIN)
    conns: dict[int, Conn] = {}
    jobs: dict[bytes, Conn] = {}
    next_job = 0
    while True:
        for item, _ in poller.poll():
            if item is dealer or item is frames:
                command, job_id, body = item.recv_multipart()
                conn = jobs[job_id]
                if command == TOKEN:
                    conn.sock.sendall(sse({"choices": [
                        {"index": 0, "text": body.decode("utf-8", "replace"),
                         "finish_reason": None}]}))
                else:
                    del jobs[job_id]
                    conn.sock.sendall(
                        sse({"choices": [{"index": 0, "text": "",
                                          "finish_reason": "length"}],
                             "usage": {"completion_tokens": int(body)}})
                        + b"10\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            elif item == listener.fileno():
                sock, _ = listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[sock.fileno()] = Conn(sock)
                poller.register(sock.fileno(), zmq.POLLIN)
            else:
                conn = conns[item]
                data = conn.sock.recv(65536)
                if not data:
                    poller.unregister(item)
                    conn.sock.close()
                    del conns[item]
                    continue
                conn.buf += data
                head, sep, rest = conn.buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(rest) < length:
                    continue
                conn.buf = rest[length:]
                if head.startswith(b"GET"):
                    conn.sock.sendall(HEALTH)
                    continue
                body = json.loads(rest[:length])
                next_job += 1
                job_id = b"%d" % next_job
                jobs[job_id] = conn
                conn.sock.sendall(HEADERS)
                dealer.send_multipart([SUBMIT, job_id, json.dumps(
                    [body["prompt"], body["max_tokens"], frames_ep]).encode()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per worker")
    parser.add_argument("--direct", action="store_true",
                        help="workers send frames to the frontend, not through the broker")
    args = parser.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="floor-pool-")
    front_ep, worker_ep = (f"ipc://{run_dir}/frontends", f"ipc://{run_dir}/workers")
    frames_ep = f"ipc://{run_dir}/frames" if args.direct else ""
    spawn = multiprocessing.get_context("spawn")
    loaded = spawn.Semaphore(0)
    procs = [spawn.Process(target=broker_main, args=(front_ep, worker_ep)),
             *(spawn.Process(target=worker_main,
                             args=(args.model, worker_ep, loaded, args.threads))
               for _ in range(args.workers))]
    def on_sigterm(*_) -> None:
        raise SystemExit(0)  # the finally below ends the children

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for p in procs:
            p.daemon = True
            p.start()
        for _ in range(args.workers):
            loaded.acquire()  # listen (and answer /health) once all can serve
        frontend = spawn.Process(target=frontend_main,
                                 args=(args.port, front_ep, frames_ep), daemon=True)
        frontend.start()
        procs.append(frontend)
        procs[0].join()  # until SIGTERM
    finally:
        for p in procs:
            p.terminate()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
