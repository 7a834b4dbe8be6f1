"""The issue's attacks on a real broker, measured: ``attack | figure``.

Run it against any checkout (``PYTHONPATH=<checkout> python -m
tests.bench.bench_limits``) to compare before and after; it starts its own
broker (plus one fake frontend and fake workers over ZeroMQ, no model) and
prints a markdown table:

1. one 16 MB body of 16 M empty arrays: how long STATUS goes unanswered;
2. one 256 MiB frame: the broker's peak RSS growth (VmHWM);
3. 200 000 STATUS from a registered frontend that never reads: RSS growth;
4. 2 000 fake workers with unique 10 KB host names that register and
   vanish: RSS growth once they have expired, log bytes, death counter; and
   the same again on the same broker (the first round's growth includes the
   allocator's high-water mark from 200 connections at a time; what the
   second round adds is what is kept).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import zmq

from protocol import messages
from tests.pool import BrokerProbe, Proc, cli, wait_until

H = messages.PROTOCOL_HEADER


def proc_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Broker:
    def __init__(self, run_dir: Path) -> None:
        self.frontends = f"ipc://{run_dir}/frontends"
        self.workers = f"ipc://{run_dir}/workers"
        self.proc = Proc("broker", cli(
            "broker", "--frontends", self.frontends, "--workers", self.workers,
            "--heartbeat-interval-s", "0.5", "--heartbeat-liveness", "3"), run_dir)
        self.ctx = zmq.Context()
        self.probe = BrokerProbe(self.frontends, ctx=self.ctx)
        wait_until(lambda: self.probe.status(1), 30, "the broker")

    def dealer(self, endpoint: str, **opts) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(endpoint)
        return sock

    def counters(self) -> dict:
        return self.probe.status(30)["counters"]

    def stop(self) -> None:
        self.probe.close()
        self.ctx.destroy(linger=0)
        self.proc.stop(60)


def empty_arrays(n_bytes: int) -> bytes:
    n = n_bytes - 5
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def attack_big_message(b: Broker) -> str:
    sock = b.dealer(b.frontends)
    sock.send_multipart([H, messages.Submit.COMMAND, empty_arrays(16 * 2**20)])
    started = time.monotonic()
    time.sleep(0.05)  # let the frame reach the broker before asking
    wait_until(lambda: b.probe.status(30), 60, "a STATUS answer")
    return f"STATUS answered after {time.monotonic() - started:.2f} s"


def attack_huge_frame(b: Broker) -> str:
    before = proc_kb(b.proc.pid, "VmHWM")
    sock = b.dealer(b.frontends)
    sock.send_multipart([H, messages.Submit.COMMAND, b"\x00" * (256 * 2**20)])
    time.sleep(3)  # the frame's transfer time; the figure is the peak after
    wait_until(lambda: b.probe.status(30), 60, "a STATUS answer")
    grown = (proc_kb(b.proc.pid, "VmHWM") - before) / 1024
    return f"peak RSS +{grown:.0f} MiB"


def attack_unread_status(b: Broker, n: int) -> str:
    before_rss = proc_kb(b.proc.pid, "VmRSS")
    before = b.counters()
    sock = b.dealer(b.frontends, RCVHWM=1, SNDHWM=0)
    sock.send_multipart(messages.Hello(os.getpid(), "hog").to_wire())
    status = messages.Status("x" * 32).to_wire()
    for _ in range(n):
        sock.send_multipart(status)

    def handled():
        c = b.counters()
        return sum(c.get(k, 0) - before.get(k, 0)
                   for k in ("status_requests", "unknown_peer")) >= n
    wait_until(handled, 600, "every STATUS handled")
    grown = (proc_kb(b.proc.pid, "VmRSS") - before_rss) / 1024
    return f"RSS +{grown:.0f} MiB"


def attack_fake_workers(b: Broker, n: int) -> str:
    before_rss = proc_kb(b.proc.pid, "VmRSS")
    before_log = b.proc.log_path.stat().st_size
    before = b.counters()

    def handled() -> int:
        c = b.counters()
        return sum(c.get(k, 0) - before.get(k, 0)
                   for k in ("worker_registrations", "malformed_dropped",
                             "worker_refused_full"))

    # In batches, so that this process's sockets (file descriptors) are
    # closed once the broker has what they sent.
    for start in range(0, n, 200):
        socks = []
        for i in range(start, min(n, start + 200)):
            sock = b.dealer(b.workers)
            host = f"{i:05d}" + "h" * 10_000
            sock.send_multipart(messages.Ready("fake", "m", 2048, i, host).to_wire())
            socks.append(sock)
        target = min(n, start + 200)
        wait_until(lambda t=target: handled() >= t, 300, "fakes handled")
        for sock in socks:
            sock.close(0)
    # No heartbeats follow: the registered ones expire.
    wait_until(lambda: b.probe.status(30)["slots_total"] == 0, 300,
               "fakes expired")
    c = b.counters()
    grown = (proc_kb(b.proc.pid, "VmRSS") - before_rss) / 1024
    log_kb = (b.proc.log_path.stat().st_size - before_log) / 1024
    deaths = c.get("worker_deaths", 0) - before.get("worker_deaths", 0)
    return (f"RSS +{grown:.1f} MiB, log +{log_kb:.0f} KiB, "
            f"{deaths} deaths counted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--status", type=int, default=200_000)
    parser.add_argument("--fakes", type=int, default=2_000)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, attack in (
            ("16 MB of empty arrays", attack_big_message),
            ("one 256 MiB frame", attack_huge_frame),
            (f"{args.status} unread STATUS",
             lambda b: attack_unread_status(b, args.status)),
            (f"{args.fakes} fake workers, 10 KB hosts (twice: is it kept?)",
             lambda b: attack_fake_workers(b, args.fakes) + "; again: "
             + attack_fake_workers(b, args.fakes)),
        ):
            run_dir = Path(tempfile.mkdtemp(dir=tmp))
            broker = Broker(run_dir)
            try:
                rows.append((name, attack(broker)))
            except AssertionError as exc:
                rows.append((name, f"failed: {exc}"))
            finally:
                broker.stop()
    print(f"checkout: {os.path.dirname(messages.__file__)}", file=sys.stderr)
    print("| attack | figure |\n|---|---|")
    for name, figure in rows:
        print(f"| {name} | {figure} |")


if __name__ == "__main__":
    main()
