"""A model worker process: one engine, one slot, one job at a time.

Two threads, which share no socket and little state:

* the main thread is the ``JobRunner`` (``workers.model.job_runner``): it
  loads the model, runs jobs through the engine, and between jobs, when
  none waits, gives the engine its idle time (saving the prompt state just
  finished). What it says to the broker it hands to the link, each message
  tagged with the job it belongs to;
* the connection's thread (``protocol.link``) owns the DEALER to the broker
  and calls the ``WorkerLink`` (``workers.model.worker_link``) back: it
  sends the runner's frames (only the current job's), heartbeats every
  interval (also while a token is being computed: ctypes releases the GIL
  during decode), and handles SUBMIT / CANCEL / CREDIT / THREADS /
  DISCONNECT and a silent broker.

The job itself (``ActiveJob``, in ``workers.model.active_job``) is the one
object both threads touch. The worker sends READY only after the model has
loaded, and again whenever the broker says DISCONNECT or goes silent (a
restarted broker rebuilds its ledger from these). SIGTERM: stop taking jobs,
let the current one finish within the grace period or end it with an ERROR,
tell the broker, exit 0.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

import zmq

from protocol import messages
from protocol.broker_list import split_endpoints
from protocol.curve import client_keys
from protocol.lifecycle import ServiceNotifier, SilentNotifier, StopSignal
from workers.model.broker_choice import BrokerChoice
from workers.model.engine import Engine
from workers.model.job_runner import EngineLoadError, JobRunner
from workers.model.settings import WorkerSettings
from workers.model.worker_link import WorkerLink

__all__ = ["EngineLoadError", "ModelWorker"]

log = logging.getLogger("llamapool.worker")


class ModelWorker:
    """Connects one engine to the broker: a ``JobRunner`` in the calling
    thread and a ``WorkerLink`` in the connection's."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], Engine],
        ctx: zmq.Context | None = None,
        notifier: ServiceNotifier | None = None,
    ) -> None:
        self.settings = settings
        #: CURVE keys for the link to the broker; None: plaintext.
        #: Raises ``CurveKeyError`` here, before any socket exists.
        self.curve = client_keys(settings.curve_server_key, settings.curve_secret_key)
        self.ctx = ctx or zmq.Context.instance()
        self.name = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        #: With several brokers, the one we are registered with (one at a
        #: time: see ``broker_choice``).
        self.brokers = BrokerChoice(split_endpoints(settings.broker_endpoint),
                                    self.name)
        # The runner's ``send`` is the link's, made just below.
        self.runner = JobRunner(settings, load_engine,
                                send=lambda out: self.link.send(out))
        self.link = WorkerLink(settings, self.name, self.brokers, self.runner,
                               notifier or SilentNotifier(),
                               curve=self.curve, ctx=self.ctx)

    @property
    def engine(self) -> Engine | None:
        """None until the model has loaded."""
        return self.runner.engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self.runner.engine = engine

    @property
    def jobs_done(self) -> int:
        return self.runner.jobs_done

    @property
    def tokens_generated(self) -> int:
        return self.runner.tokens_generated

    @property
    def busy(self) -> bool:
        return self.runner.busy

    @property
    def cache_report(self) -> messages.CacheReport | None:
        """The last CACHE_REPORT built (for metrics)."""
        return self.runner.cache_report

    @property
    def malformed_dropped(self) -> int:
        """Malformed messages from the broker, dropped."""
        return self.link.connection.malformed_dropped

    @property
    def unsent_dropped(self) -> int:
        """Messages to the broker dropped because its connection was gone."""
        return self.link.connection.unsent_dropped

    @property
    def registered(self) -> bool:
        """Loaded, and a broker holds this worker in its ledger."""
        return self.link.registered

    @property
    def link_beat_at(self) -> float | None:
        """When the link thread last beat (monotonic), None before."""
        return self.link.last_beat_at

    @property
    def link_callback_errors(self) -> int:
        """Bugs caught in the link's callbacks (logged; the link went on)."""
        return self.link.connection.callback_errors

    def run(self, stop: StopSignal) -> None:
        """Serve jobs until ``stop`` is set and the current job has ended.

        Raises:
            EngineLoadError: the model did not load, or its warm-up failed.
        """
        self.link.start(stop)
        try:
            if self.settings.held:
                # A crash loop its supervisor stopped: LOADING heartbeats
                # with the failure are all this process does.
                log.error("worker %s held: %s; not loading the model",
                          self.name, self.settings.last_failure)
                stop.wait(None)
                return
            self.runner.run(stop)
        finally:
            stop.set()  # also on a failed load: the link thread says goodbye
            self.link.connection.join(
                timeout_s=self.settings.heartbeat_interval_s * 3)
            self.runner.close()
            log.info("worker %s stopped after %d jobs", self.name,
                     self.runner.jobs_done)
