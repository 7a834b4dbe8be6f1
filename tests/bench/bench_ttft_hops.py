"""Where the time to first token goes, hop by hop (issue 15).

    make bench-ttft-hops      # or: python -m tests.bench.bench_ttft_hops

Starts ``llamapool up --workers 1`` with ``tests/bench/hop_trace`` first on
``PYTHONPATH`` and ``LLAMAPOOL_HOP_TRACE`` set: every process of the pool then
records when a request reaches each point of its path
(``hop_trace/sitecustomize.py``; no llamapool code knows about it). It sends
``--requests`` streamed completions one at a time, and alternates them with
an in-process ``Llama`` that tokenises the same text and generates up to its
first token, which is what any server must do for it. Prints the median of
each segment, in path order, and what is left of the client's TTFT outside
the traced path (the client, the TCP hops, gunicorn's accept and read).

For scale, the same requests go to llama.cpp's own ``llama-server`` in the
same rotation, set to do the model work our worker does: one slot, one
thread, ``-fa off`` and ``--swa-full`` as our workers run (without the full
SWA cache it prefills the whole prompt again for Gemma 3), ``--cache-ram 0``
(it would save the last reply's state in the next request's time; our
worker does that between jobs). What it adds over the in-process loop is
what a one-process C++ HTTP server adds on this machine. The floor
(``tests/bench/floor_pool.py``, one worker) is the pool's processes and
ZeroMQ hops with none of its code: what it adds is what that shape costs.

``--before DIR`` traces a second pool, running the code of another checkout
(``git clone . /tmp/before && git -C /tmp/before checkout <commit>``), in
the same rotation, and prints its segments beside this checkout's: a change
on the request's path, measured in the same minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import tempfile
import time
from pathlib import Path

from tests.bench import harness
from tests.bench.bench_overhead import PROMPT

HOOK_DIR = Path(__file__).with_name("hop_trace")

#: (from, to, where, what): each segment ends at the first ``to`` after its
#: ``from``; ``where`` says which process's records count (a label such as
#: ``link.recv`` is recorded by every process).
SEGMENTS = [
    ("http.readable", "http.whole", "frontend",
     "gunicorn's event loop: request read whole"),
    ("http.whole", "http.thread", "frontend",
     "HAND-OFF: event loop -> a request thread (gunicorn's thread pool)"),
    ("http.thread", "http.request", "frontend",
     "gunicorn: request parsed in the thread"),
    ("http.request", "responder.in", "frontend",
     "frontend: Falcon's request, routing, middleware (request id, log, auth)"),
    ("responder.in", "gate.in", "frontend",
     "frontend: body read, JSON parsed and checked"),
    ("gate.in", "gate.out", "frontend",
     "frontend: prompt tokenised and checked against the context"),
    ("gate.out", "send.Submit", "frontend",
     "frontend: lease and job set up, SUBMIT built"),
    ("send.Submit", "write.Submit", "frontend",
     "HAND-OFF: request thread -> link thread (SUBMIT queued, written)"),
    ("write.Submit", "broker.drain", "broker",
     "ZeroMQ frontend -> broker"),
    ("broker.drain", "broker.submit.in", "broker",
     "broker: SUBMIT received, decoded, dispatched"),
    # Up to the send to the worker: ACCEPTED and the bookkeeping after it are
    # off the path, and the worker often has the SUBMIT before they end.
    ("broker.submit.in", "broker.to_worker", "broker",
     "broker: slot leased, SUBMIT sent on"),
    ("broker.to_worker", "link.recv", "worker",
     "ZeroMQ broker -> worker"),
    ("link.recv", "worker.msg.Submit", "worker",
     "worker: SUBMIT received, decoded"),
    ("worker.msg.Submit", "worker.picked", "worker",
     "HAND-OFF: worker's link thread -> its main thread (the job)"),
    ("worker.picked", "worker.prepared", "worker",
     "worker: prompt-state lookup, KV-cache plan"),
    ("worker.prepared", "worker.emit", "worker",
     "MODEL: prefill and first token sampled"),
    ("worker.emit", "send.Token", "worker",
     "worker: TOKEN built"),
    ("send.Token", "write.Token", "worker",
     "HAND-OFF: worker's main thread -> its link thread (TOKEN encoded, queued)"),
    ("write.Token", "broker.relay", "broker",
     "ZeroMQ worker -> broker"),
    ("broker.relay", "link.recv", "frontend",
     "broker relays; ZeroMQ broker -> frontend"),
    ("link.recv", "put.Token", "frontend",
     "frontend: link thread decodes the TOKEN"),
    ("put.Token", "stream.got", "frontend",
     "HAND-OFF: link thread -> request thread (the first TOKEN)"),
    ("stream.got", "responder.out", "frontend",
     "frontend: first frame taken, response set up, responder returns"),
    ("responder.out", "falcon.out", "frontend",
     "Falcon finishes the response (middleware, headers, start_response)"),
    ("falcon.out", "sse.chunk", "frontend",
     "gunicorn starts the body; first SSE chunk built"),
    ("sse.chunk", "http.write", "frontend",
     "gunicorn: headers and the chunk written to the socket"),
]
MODEL_SEGMENT = "MODEL: prefill and first token sampled"
TOKENISE_SEGMENT = "frontend: prompt tokenised and checked against the context"


def read_records(prefix: str, since: float) -> list[tuple[float, str, int]]:
    """Every process's records from ``since`` on (``perf_counter``, one clock
    for all processes), as (time, label, pid), in time order."""
    records = []
    for path in glob.glob(prefix + ".*"):
        pid = int(path.rsplit(".", 1)[1])
        with open(path) as f:
            for line in f:
                label, t = line.split()
                if float(t) >= since:
                    records.append((float(t), label, pid))
    records.sort()
    return records


def process_roles(records) -> dict[int, str]:
    """pid -> frontend / broker / worker, by what each process recorded."""
    roles = {}
    for _, label, pid in records:
        if label.startswith("http."):
            roles[pid] = "frontend"
        elif label.startswith("broker."):
            roles[pid] = "broker"
        elif label.startswith("worker."):
            roles[pid] = "worker"
    return roles


def segments_of_requests(records) -> list[dict[str, float]]:
    """Per request (one at a time, so a request is everything between two
    ``http.readable`` records): each segment's length in ms."""
    roles = process_roles(records)
    starts = [i for i, (_, label, _) in enumerate(records) if label == "http.readable"]
    out = []
    for begin, end in zip(starts, [*starts[1:], len(records)]):
        window = records[begin:end]
        times = {"http.readable": window[0][0]}
        lengths: dict[str, float] = {}
        for start, stop, where, what in SEGMENTS:
            at = next((t for t, label, pid in window
                       if label == stop and roles.get(pid) == where
                       and t >= times[start]), None)
            if at is None:
                break  # a request not traced whole: left out
            times[stop] = at
            lengths[what] = (at - times[start]) * 1000
        else:
            out.append(lengths)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="GGUF, or tiny: the test model (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int,
                        default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=2,
                        help="tokens per request (the reply the next request's "
                             "prompt-cache step sees in the KV cache)")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="also trace the pool of another checkout, in the "
                             "same rotation, and print its segments beside ours")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 5
    model = harness.model_path(args.model)
    checkouts = {f"this ({harness.checkout_commit('.')})": os.getcwd()}
    if args.before:
        checkouts[f"before ({harness.checkout_commit(args.before)})"] = args.before
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as pools:
        llama = harness.load_llama(model, args.threads)
        urls, prefixes = {}, {}
        for i, (name, checkout) in enumerate(checkouts.items()):
            prefixes[name] = os.path.join(tmp, f"hops{i}")
            env = dict(os.environ, LLAMAPOOL_HOP_TRACE=prefixes[name],
                       PYTHONPATH=os.pathsep.join(
                           [str(HOOK_DIR), os.environ.get("PYTHONPATH", "")]))
            server, urls[name] = harness.llamapool_up(
                model, workers=1, threads=args.threads, env=env, checkout=checkout)
            # Stopped before the records are read: the processes flush them
            # as they exit.
            pools.callback(server.stop)
        client_ttft = {name: [] for name in checkouts}
        local_ttft, peer_ttft, floor_ttft = [], [], []
        with contextlib.ExitStack() as others:
            peer, peer_url = harness.llama_server(
                model, slots=1, n_threads=args.threads,
                extra=("-fa", "off", "--swa-full", "--cache-ram", "0"))
            others.callback(peer.stop)
            floor, floor_url = harness.floor_pool(model, workers=1)
            others.callback(floor.stop)
            for warm_up in (*urls.values(), peer_url, floor_url):  # prefix caches
                harness.stream_once(warm_up, PROMPT, 2)
            local_first_token(llama)
            since = time.perf_counter()
            for i in range(args.requests):
                # Alternating which pool goes first: the first request after
                # the others' finds colder caches.
                for name, url in (list(urls.items())[::-1] if i % 2 else urls.items()):
                    client_ttft[name].append(
                        harness.stream_once(url, PROMPT, args.tokens).ttft_s * 1000)
                local_ttft.append(local_first_token(llama) * 1000)
                peer_ttft.append(harness.stream_once(
                    peer_url, PROMPT, args.tokens).ttft_s * 1000)
                floor_ttft.append(harness.stream_once(
                    floor_url, PROMPT, args.tokens).ttft_s * 1000)
        pools.close()
        rows = {name: segments_of_requests(read_records(prefixes[name], since))
                for name in checkouts}
    for name, traced_rows in rows.items():
        if not traced_rows:
            raise SystemExit(f"{name}: no complete request in the records")
    print(f"## Time to first token, hop by hop ({os.path.basename(model)}, "
          f"{args.threads} thread(s), {args.tokens} tokens per request, "
          + ", ".join(f"{name}: {len(r)} of {args.requests} requests traced whole"
                      for name, r in rows.items()) + "; medians, ms)\n")
    local = harness.median(local_ttft)
    table = [[what, *(harness.median([r[what] for r in rows[name]])
                      for name in checkouts)]
             for _, _, _, what in SEGMENTS]

    def each(figure) -> list[float]:
        return [figure(name) for name in checkouts]

    def model_ms(name: str) -> float:
        return harness.median([r[MODEL_SEGMENT] for r in rows[name]])

    def traced(name: str) -> float:
        return harness.median([sum(r.values()) for r in rows[name]])

    def client(name: str) -> float:
        return harness.median(client_ttft[name])

    table += [
        ["traced path: request readable to first chunk written", *each(traced)],
        ["client TTFT (client sends -> reads the first token)", *each(client)],
        ["outside it: the client's send, TCP both ways, epoll wake-up, "
         "the client reading the event", *each(lambda n: client(n) - traced(n))],
        ["added by the pool, counted hop by hop: client TTFT - MODEL",
         *each(lambda n: client(n) - model_ms(n))],
        ["the same without the frontend's tokenising (the in-process side "
         "does it too)",
         *each(lambda n: client(n) - model_ms(n) - harness.median(
             [r[TOKENISE_SEGMENT] for r in rows[n]]))],
        ["added by the pool: client TTFT - in-process",
         *each(lambda n: client(n) - local)],
    ]
    for label, value in [
        ("in-process Llama: tokenise + prefill + first token", local),
        (f"llama-server -np 1 -t {args.threads} -fa off --swa-full "
         "--cache-ram 0: client TTFT", harness.median(peer_ttft)),
        ("added by llama-server: its client TTFT - in-process",
         harness.median(peer_ttft) - local),
        ("floor (the pool's processes and hops, no work): client TTFT",
         harness.median(floor_ttft)),
        ("added by the floor: its client TTFT - in-process",
         harness.median(floor_ttft) - local),
    ]:
        table.append([label, value, *([""] * (len(checkouts) - 1))])
    print(harness.md_table(["segment", *checkouts], table))
    return 0


def local_first_token(llama) -> float:
    """Seconds to tokenise ``PROMPT`` and generate one token in process."""
    started = time.perf_counter()
    tokens = llama.tokenize(PROMPT.encode("utf-8"), special=True)
    from workers.model import kv_cache
    from workers.model.kv_sequence import LlamaSequence
    plan = kv_cache.plan_reuse(LlamaSequence(llama), tokens)
    gen = llama.generate(plan.tokens, reset=plan.reset, **harness.SAMPLING)
    try:
        next(gen)
    finally:
        gen.close()
    return time.perf_counter() - started


if __name__ == "__main__":
    raise SystemExit(main())
