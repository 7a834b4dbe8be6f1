"""A whole pool in this process, for frontend tests that need no process.

The real ``Broker`` and real ``ModelWorker``s with the synthetic engine run
in threads, on ``inproc://`` endpoints of one shared ZeroMQ context (as
vLLM's ``InprocClient`` runs its engine core in the caller's process); the
Falcon app from ``frontend.app.create_app(settings)`` is driven with
``falcon.testing.TestClient``. Nothing is forked or executed, so these tests
belong to ``make test-unit``: no ``@pytest.mark.stack``. Every claim they
check is also tested through real processes (``tests/pool.py``); these are
the frontend's own logic (validation, headers, the SSE shape) run fast.

Stopping is as the processes do it on SIGTERM: each service's ``StopSignal``
is set and its thread must end within ``STOP_TIMEOUT_S``, or the test fails.
"""

from __future__ import annotations

import json
import threading
import uuid

import falcon.testing
import zmq

from frontend.app import LlamapoolApp, create_app
from frontend.broker_link import BrokerLink
from frontend.settings import FrontendSettings
from tests.pool import STOP_TIMEOUT_S, BrokerProbe, wait_all_free
from workers.broker.broker import Broker
from workers.broker.settings import BrokerSettings
from workers.model.settings import WorkerSettings
from workers.model.synthetic_engine import SyntheticEngine
from workers.model.worker import ModelWorker

#: As the process pools' TEST_HEARTBEAT: a lost peer is noticed within 0.6 s.
HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_liveness": 3}
#: Fast enough that a test's streams end at once, slow enough to be a stream.
TOKENS_PER_SECOND = 2000.0


class _Service:
    """A broker's or worker's ``run(stop)`` in a thread, stopped like a
    process on SIGTERM: the flag is set, the thread must end in time."""

    def __init__(self, name: str, run) -> None:
        self.name = name
        self.stop_flag = threading.Event()  # a StopSignal
        self.error: BaseException | None = None

        def main() -> None:
            try:
                run(self.stop_flag)
            except BaseException as exc:  # shown by stop(), never lost
                self.error = exc

        self.thread = threading.Thread(target=main, name=name, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.stop_flag.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise AssertionError(f"{self.name} did not stop within {timeout_s}s")
        if self.error is not None:
            raise AssertionError(f"{self.name} failed: {self.error!r}") from self.error


class InprocPool:
    """Broker + synthetic workers in threads, and Falcon apps over them.

    ``client(**frontend_settings)`` is a ``falcon.testing.TestClient`` on a
    new app (its own ``BrokerLink``) with those ``FrontendSettings`` fields,
    so one pool serves apps with and without API keys, body limits...
    """

    def __init__(self, *, workers: int = 2,
                 tokens_per_second: float = TOKENS_PER_SECOND,
                 n_ctx: int = 2048, model_name: str = "synthetic") -> None:
        self.ctx = zmq.Context()
        name = uuid.uuid4().hex[:12]
        self.frontends_ep = f"inproc://pool-{name}-frontends"
        self.workers_ep = f"inproc://pool-{name}-workers"
        self.n_workers = workers
        self._links: list[BrokerLink] = []
        self.workers: list[ModelWorker] = []
        self._services: list[_Service] = []
        self.probe: BrokerProbe | None = None
        try:
            # Bound before anyone connects (inproc needs no order, but the
            # broker's socket options are then in force from the start).
            self.broker = Broker(BrokerSettings(
                frontends_endpoint=self.frontends_ep,
                workers_endpoint=self.workers_ep, **HEARTBEAT), ctx=self.ctx)
            self.broker.bind()
            self._services.append(_Service("broker", self.broker.run))
            for i in range(workers):
                settings = WorkerSettings(
                    broker_endpoint=self.workers_ep, engine="synthetic",
                    tokens_per_second=tokens_per_second, n_ctx=n_ctx,
                    model_name=model_name, worker_name=f"inproc-worker-{i}",
                    shutdown_grace_s=1.0, **HEARTBEAT)
                worker = ModelWorker(
                    settings,
                    lambda: SyntheticEngine(tokens_per_second=tokens_per_second,
                                            n_ctx=n_ctx, model_name=model_name),
                    ctx=self.ctx)
                self.workers.append(worker)
                self._services.append(_Service(f"worker-{i}", worker.run))
            self.probe = BrokerProbe(self.frontends_ep, ctx=self.ctx)
            self.wait_free(workers, timeout_s=30)
        except BaseException:
            self.stop()
            raise

    # --- the frontend -------------------------------------------------------------

    def app(self, **settings) -> LlamapoolApp:
        """``create_app`` with these ``FrontendSettings`` fields, on this pool."""
        fields = {"broker_endpoint": self.frontends_ep, **HEARTBEAT, **settings}
        frontend = FrontendSettings(**fields)
        link = BrokerLink(frontend.broker_endpoint,
                          heartbeat_interval_s=frontend.heartbeat_interval_s,
                          heartbeat_liveness=frontend.heartbeat_liveness,
                          ctx=self.ctx)
        self._links.append(link)
        return create_app(frontend, link=link)

    def client(self, **settings) -> falcon.testing.TestClient:
        # Addressed as a local client addresses the pool: Falcon's default
        # Host (falconframework.org) is a name the pool does not serve.
        return falcon.testing.TestClient(self.app(**settings),
                                         headers={"Host": "localhost"})

    # --- ledger checks, as ``tests.pool.Pool`` has them ----------------------------

    def status(self) -> dict:
        snap = self.probe.status()
        assert snap is not None, "the broker did not answer STATUS"
        return snap

    def submitted(self) -> int:
        """Jobs the broker has been given, ever (a refused request adds none)."""
        return self.status()["counters"].get("submitted", 0)

    def wait_free(self, n: int, timeout_s: float = 15.0) -> dict:
        return wait_all_free(self.probe, n, timeout_s)

    def assert_whole(self, timeout_s: float = 15.0) -> dict:
        """Free slots equal live workers."""
        live = sum(1 for s in self._services[1:] if s.alive())
        return self.wait_free(live, timeout_s)

    def stop(self) -> None:
        """Frontend links, then workers, then the broker; each must end."""
        for link in self._links:
            link.close()
        if self.probe is not None:
            self.probe.close()
        errors = []
        # Workers first, so their goodbyes reach a broker that still runs.
        for service in [*self._services[1:], *self._services[:1]]:
            try:
                service.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        # Every socket is closed by now unless a thread hung: then linger 0,
        # so the test fails on the message above instead of hanging here.
        self.ctx.destroy(linger=0)
        if errors:
            raise AssertionError("; ".join(errors))


def sse_events(body: str) -> list[dict | str]:
    """The ``data:`` events of an SSE body: JSON objects, and ``[DONE]``."""
    events = []
    for line in body.split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events

