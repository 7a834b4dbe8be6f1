"""Two brokers sharing one pool, as real processes (tests and bench-brokers).

Broker ``i`` binds ``ipc://<run_dir>/frontends<i>`` and ``.../workers<i>``
(with ``transport="tcp"``, two loopback TCP ports instead); every worker is
given every broker's workers endpoint, the frontend every broker's frontends
endpoint (``--broker`` repeated). Worker names are chosen so that
``BrokerChoice`` starts worker ``j`` on broker ``j % n``: the test knows
where each one is before any fault.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until


def worker_name_for(broker_index: int, n_brokers: int, serial: int) -> str:
    """A worker name whose crc32 starts it on ``broker_index``."""
    for salt in range(10_000):
        name = f"w{serial}-{salt}"
        if zlib.crc32(name.encode()) % n_brokers == broker_index:
            return name
    raise AssertionError("no name found")  # unreachable for small n


class BrokersPool:
    """``n_brokers`` brokers, ``n_workers`` workers, one gunicorn frontend."""

    def __init__(self, run_dir: Path, *, n_brokers: int = 2, n_workers: int = 2,
                 worker_args: tuple[str, ...] = (), heartbeat=TEST_HEARTBEAT,
                 frontend_processes: int = 2, wait_ready: bool = True,
                 frontend_args: tuple[str, ...] = (),
                 transport: str = "ipc") -> None:
        self.run_dir = run_dir
        self.heartbeat = list(heartbeat)
        if transport == "tcp":
            # As deployed: a dead broker's peers see its TCP connections end
            # and redial a refused port, not a socket file.
            def endpoint(_: str) -> str:
                return f"tcp://127.0.0.1:{free_port()}"
        else:
            def endpoint(name: str) -> str:
                return f"ipc://{run_dir}/{name}"
        self.frontends_eps = [endpoint(f"frontends{i}") for i in range(n_brokers)]
        self.workers_eps = [endpoint(f"workers{i}") for i in range(n_brokers)]
        self.brokers: list[Proc] = [self._start_broker(i) for i in range(n_brokers)]
        self.probes = [BrokerProbe(ep) for ep in self.frontends_eps]
        self.workers: list[Proc] = []
        self.frontend: Proc | None = None
        try:
            # Every broker answers before any worker starts: a worker whose
            # first broker is slow to start (a loaded machine) would rightly
            # move to the next one, and the placement the tests rely on
            # would be lost.
            for i in range(n_brokers):
                wait_until(lambda i=i: self.status(i) is not None, 60,
                           f"broker {i} to answer STATUS")
        except BaseException:
            self.stop()
            raise
        for j in range(n_workers):
            name = worker_name_for(j % n_brokers, n_brokers, j)
            broker_flags = [a for ep in self.workers_eps for a in ("--broker", ep)]
            self.workers.append(Proc(
                f"worker{j}",
                cli("worker", *broker_flags, "--worker-name", name,
                    *self.heartbeat, *worker_args),
                run_dir))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update({"LLAMAPOOL_FRONTEND_PROCESSES": str(frontend_processes),
                    "LLAMAPOOL_FRONTEND_THREADS": "32"})
        broker_flags = [a for ep in self.frontends_eps for a in ("--broker", ep)]
        self.frontend = Proc(
            "frontend",
            cli("frontend", *broker_flags, "--bind", f"127.0.0.1:{self.port}",
                *self.heartbeat, *frontend_args),
            run_dir, env=env)
        if wait_ready:
            try:
                self._wait_ready(n_brokers, n_workers)
            except BaseException:
                self.stop()  # no process outlives a pool that never came up
                raise

    def _wait_ready(self, n_brokers: int, n_workers: int) -> None:
        per_broker = [0] * n_brokers
        for j in range(n_workers):
            per_broker[j % n_brokers] += 1
        for i, n in enumerate(per_broker):
            self.wait_free(i, n, timeout_s=60)
        wait_until(self.http_up, 60, "gunicorn to answer /health")

    def _start_broker(self, i: int) -> Proc:
        return Proc(f"broker{i}",
                    cli("broker", "--frontends", self.frontends_eps[i],
                        "--workers", self.workers_eps[i], *self.heartbeat),
                    self.run_dir)

    def restart_broker(self, i: int) -> None:
        """Start broker ``i`` again after it was killed."""
        assert not self.brokers[i].alive()
        self.brokers[i] = self._start_broker(i)

    def http_up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def status(self, i: int, timeout_s: float = 1.0) -> dict | None:
        return self.probes[i].status(timeout_s=timeout_s)

    def slots(self, i: int) -> tuple[int, int] | None:
        """(slots_total, slots_free) in broker ``i``'s ledger, or None."""
        snap = self.status(i)
        return None if snap is None else (snap["slots_total"], snap["slots_free"])

    def wait_free(self, i: int, n: int, timeout_s: float = 15.0) -> None:
        wait_until(lambda: self.slots(i) == (n, n), timeout_s,
                   f"{n} free slots in broker {i}'s ledger")

    def logs(self) -> str:
        procs = [*self.brokers, *self.workers]
        procs += [self.frontend] if self.frontend is not None else []
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in procs)

    def stop(self) -> None:
        for probe in self.probes:
            probe.close()
        errors = []
        frontend = [self.frontend] if self.frontend is not None else []
        for proc in [*frontend, *self.workers, *self.brokers]:
            if not proc.alive():
                continue
            try:
                proc.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        if errors:
            raise AssertionError("; ".join(errors))
