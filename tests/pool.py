"""Real processes for tests: broker, model workers and gunicorn over loopback.

Every process is started as users start it (``python -m llamapool ...``)
and stopped with SIGTERM; one that does not exit in time fails the test.
Readiness and recovery are waited for by polling a condition with a
deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import zmq

from protocol import messages

STOP_TIMEOUT_S = 20.0
#: Fast liveness for tests: a dead peer is noticed within about 0.6 s.
TEST_HEARTBEAT = ["--heartbeat-interval-s", "0.2", "--heartbeat-liveness", "3"]
#: Worker flags for a test that compares greedy texts token for token
#: (a cached or restored prompt against a cold one, a job beside others
#: against alone, before and after a thread change): exact only without
#: flash attention, whose sums run in another order for another split
#: of the work (docs/operations.md, "Flash attention").
EXACT_GREEDY = ("--flash-attn", "off")


def _die_with_parent() -> None:
    """If pytest itself is killed, its children must not linger."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


#: Ports are drawn from here, not from bind(0): see ``free_port``.
_PORT_PICKER = random.SystemRandom()  # immune to tests that seed ``random``
#: The lowest port ``free_port`` draws from.
_LOWEST_PORT = 10000


def _lowest_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # free on every address
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port free now on every address, for a child process to bind.

    Between this pick and the child's bind, another socket can take the
    port: in CI, a worker once died on its --metrics-port that way. So the
    pick is from below the kernel's ephemeral range, where no outgoing
    connection's source port and no bind(0) on the machine can land; only
    another explicit bind can take it.
    """
    low = _lowest_ephemeral_port()
    if low - _LOWEST_PORT < 1000:  # an unusual range: fall back to bind(0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    while True:
        port = _PORT_PICKER.randrange(_LOWEST_PORT, low)
        if _bindable(port):
            return port


def scrape_metrics(url: str, headers: dict | None = None,
                   timeout_s: float = 120) -> dict:
    """A ``/metrics`` page as {(name, sorted label pairs): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.02):
    """Poll ``condition`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class Proc:
    """A child process with its log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env=None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.log_file = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            argv, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait. Raises if the process hangs (after killing it)."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._dump_stacks()
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
            raise AssertionError(
                f"{self.name} hung on SIGTERM; log: {self.log()}") from None
        finally:
            self.log_file.close()
        return code

    def _dump_stacks(self) -> None:
        """Have a hung broker or worker write its threads' stacks into its
        log (``llamapool.signals.dump_stacks_on_sigusr1``), for the failure
        message."""
        if not any(role in self.argv for role in ("broker", "worker")):
            return
        self.popen.send_signal(signal.SIGUSR1)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: "most recent call first" in self.log(), 5,
                       "the stacks in the log")

    def kill(self) -> None:
        """SIGKILL the whole process group (gunicorn's children included)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        self.log_file.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def cli(*args: str) -> list[str]:
    """argv for the real CLI; global flags (``--log-format``) go first."""
    return [sys.executable, "-m", "llamapool", "--log-level", "info", *args]


def wait_all_free(probe, n: int, timeout_s: float) -> dict:
    """Wait until ``probe``'s broker ledger shows exactly ``n`` slots, all
    free; its snapshot."""
    def whole():
        snap = probe.status(timeout_s=1.0)
        if snap and snap["slots_total"] == n and snap["slots_free"] == n:
            return snap
        return None
    return wait_until(whole, timeout_s, f"{n} free slots in the broker ledger")


class BrokerProbe:
    """Asks the broker for its ledger over the real frontend socket, as a
    frontend does: registered with HELLO (the broker answers STATUS only to
    registered frontends), and again after a DISCONNECT (a broker restart).

    ``keys`` (``protocol.curve.ClientKeys``) makes it an authorized CURVE
    client, for brokers that require one.
    """

    def __init__(self, endpoint: str, keys=None, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(endpoint)
        self._hello()

    def _hello(self) -> None:
        self.sock.send_multipart(
            messages.Hello(os.getpid(), "broker-probe").to_wire())

    def status(self, timeout_s: float = 2.0) -> dict | None:
        """The broker's snapshot as a dict (``PoolStatus.to_dict``), or None."""
        request_id = uuid.uuid4().hex
        self.sock.send_multipart(messages.Status(request_id).to_wire())
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.sock.poll(remaining * 1000):
                return None
            msg = messages.decode(self.sock.recv_multipart())
            if isinstance(msg, messages.StatusReply) and msg.request_id == request_id:
                return msg.snapshot.to_dict()
            if isinstance(msg, messages.Disconnect):
                # A (re)started broker does not know us: register, ask again.
                self._hello()
                self.sock.send_multipart(messages.Status(request_id).to_wire())
        return None

    def close(self) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()


class Pool:
    """Broker + workers + gunicorn frontend, all real processes."""

    def __init__(self, model_path: Path, run_dir: Path, *, workers: int = 2,
                 api_keys: tuple[str, ...] = (), frontend_env: dict | None = None,
                 worker_args: tuple[str, ...] = (), wait_ready: bool = True,
                 global_args: tuple[str, ...] = (),
                 frontend_tokenizes: bool = True,
                 broker_args: tuple[str, ...] = (),
                 worker_env: dict | None = None,
                 slots_per_worker: int = 1) -> None:
        self.model_path = model_path
        #: Each worker's ``--slots``: the ledger holds this many per worker.
        self.slots_per_worker = slots_per_worker
        self.run_dir = run_dir
        self.frontends_ep = f"ipc://{run_dir}/frontends"
        self.workers_ep = f"ipc://{run_dir}/workers"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_keys = api_keys
        self.worker_args = worker_args
        #: Variables set for every worker on top of the test's own.
        self.worker_env = worker_env
        self.global_args = global_args
        self.broker_args = broker_args
        self.workers: list[Proc] = []
        self.frontend: Proc | None = None
        self.probe: BrokerProbe | None = None
        self._worker_serial = 0
        self.broker = self._start_broker()
        try:
            for _ in range(workers):
                self.start_worker()
            env = dict(os.environ)
            env.update({"LLAMAPOOL_FRONTEND_PROCESSES": "2",
                        "LLAMAPOOL_FRONTEND_THREADS": "32"})
            env.update(frontend_env or {})
            key_args = [a for k in api_keys for a in ("--api-key", k)]
            self.frontend = Proc(
                "frontend",
                cli(*global_args, "frontend", "--broker", self.frontends_ep,
                    "--bind", f"127.0.0.1:{self.port}",
                    # Without the model file the workers tokenise every prompt.
                    *(("--model", str(model_path)) if frontend_tokenizes else ()),
                    "--ctx", "2048", *key_args, *TEST_HEARTBEAT),
                run_dir, env=env,
            )
            self.probe = BrokerProbe(self.frontends_ep)
            if wait_ready:
                self.wait_free(workers * slots_per_worker, timeout_s=60)
                wait_until(self.http_up, 60, "gunicorn to answer /health")
        except BaseException as exc:
            # No process (and no probe's context) outlives a pool that never
            # came up: the caller has no pool to stop. The logs say why.
            logs = self.logs()
            with contextlib.suppress(AssertionError):  # the first error counts
                self.stop()
            if not isinstance(exc, Exception):
                raise
            raise AssertionError(f"the pool did not start: {exc}\n{logs}") from exc

    def _start_broker(self) -> Proc:
        return Proc("broker", cli("broker", "--frontends", self.frontends_ep,
                                  "--workers", self.workers_ep, *TEST_HEARTBEAT,
                                  *self.broker_args),
                    self.run_dir)

    def start_worker(self) -> Proc:
        self._worker_serial += 1
        proc = Proc(
            f"worker{self._worker_serial}",
            cli("worker", "--broker", self.workers_ep, "--model", str(self.model_path),
                "--threads", "1", "--ctx", "2048", *TEST_HEARTBEAT,
                *(("--slots", str(self.slots_per_worker))
                  if self.slots_per_worker > 1 else ()),
                *self.worker_args),
            self.run_dir,
            env={**os.environ, **self.worker_env} if self.worker_env else None,
        )
        self.workers.append(proc)
        return proc

    def restart_broker(self, kill: bool = False) -> None:
        if kill:
            self.broker.kill()
        else:
            self.broker.stop()
        self.broker = self._start_broker()

    def http_up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    # --- ledger checks ---------------------------------------------------------

    def status(self) -> dict:
        snap = self.probe.status()
        assert snap is not None, "the broker did not answer STATUS"
        return snap

    def live_workers(self) -> int:
        return sum(1 for w in self.workers if w.alive())

    def wait_free(self, n: int, timeout_s: float = 15.0) -> dict:
        """Wait until the ledger shows exactly ``n`` slots, all free."""
        return wait_all_free(self.probe, n, timeout_s)

    def assert_whole(self, timeout_s: float = 15.0) -> dict:
        """Free slots return to the number of live workers."""
        return self.wait_free(self.live_workers() * self.slots_per_worker,
                              timeout_s)

    def _procs(self) -> list[Proc]:
        frontend = [self.frontend] if self.frontend is not None else []
        return [*frontend, *self.workers, self.broker]

    def logs(self) -> str:
        procs = [self.broker, *self._procs()[:-1]]
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in procs)

    def stop(self) -> None:
        """SIGTERM everything: frontend, workers, broker. All must exit."""
        if self.probe is not None:
            self.probe.close()
            self.probe = None  # stop() may be called again: once is enough
        errors = []
        for proc in self._procs():
            if not proc.alive():
                continue
            try:
                proc.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        if errors:
            raise AssertionError("; ".join(errors))


def sse_events(raw_lines) -> list[dict | str]:
    """Parse ``data:`` lines of an SSE stream into JSON objects (or '[DONE]')."""
    events = []
    for line in raw_lines:
        if isinstance(line, bytes):
            line = line.decode()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
