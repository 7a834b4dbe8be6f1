"""A model worker of several slots (``llamapool worker --slots K``).

One process, one model, one llama.cpp context with K sequences, decoded as
one batch by one thread; to the broker, K slots. Each slot is a link of its
own (a ``WorkerLink`` with its own DEALER and connection thread), named
``<worker name>#<i>``, that registers, heartbeats and is leased, cancelled
and released exactly as a one-slot worker is: the broker needs no notion of
a worker with several slots, and its ledger, 503s, ``id_slot``, CANCEL and
its deadline, and the death of a silent worker hold per slot unchanged.

Threads:

* the main thread is the ``BatchRunner`` (``workers.model.batch_runner``):
  it owns the engine and its context and runs the decode loop;
* K link threads, one per slot (``protocol.link``), each sending its own
  slot's frames and heartbeats and handing its SUBMITs to the runner
  through its ``SlotPort``.

When the process dies, every link goes silent at once and the broker ends
each slot's job with its own ERROR. With ``--slots 1`` the worker is the
one-slot ``ModelWorker`` of ``workers.model.worker``, not this.
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
from workers.model.batch_runner import BatchRunner
from workers.model.batched_engine import BatchedEngine
from workers.model.broker_choice import BrokerChoice
from workers.model.settings import WorkerSettings
from workers.model.worker_link import WorkerLink

log = logging.getLogger("llamapool.worker")


class BatchedWorker:
    """K slots of one batched engine, each linked to the broker on its own;
    the attributes ``llamapool worker --metrics-port`` reads are the
    worker's, over all its slots."""

    def __init__(
        self,
        settings: WorkerSettings,
        load_engine: Callable[[], BatchedEngine],
        ctx: zmq.Context | None = None,
        notifier: ServiceNotifier | None = None,
    ) -> None:
        self.settings = settings
        curve = client_keys(settings.curve_server_key, settings.curve_secret_key)
        self.ctx = ctx or zmq.Context.instance()
        self.name = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.runner = BatchRunner(settings, load_engine)
        endpoints = split_endpoints(settings.broker_endpoint)
        self.links: list[WorkerLink] = []
        for port in self.runner.ports:
            name = f"{self.name}#{port.seq}"
            # systemd hears from the first slot only (one unit, one state).
            link = WorkerLink(settings, name, BrokerChoice(endpoints, name), port,
                              (notifier or SilentNotifier()) if port.seq == 0
                              else SilentNotifier(),
                              curve=curve, ctx=self.ctx)
            port.send = link.send
            self.links.append(link)

    @property
    def engine(self) -> BatchedEngine | None:
        return self.runner.engine

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
        """Slot 0's last report: the one with the worker's cache figures."""
        return self.runner.ports[0].cache_report

    @property
    def malformed_dropped(self) -> int:
        return sum(link.connection.malformed_dropped for link in self.links)

    @property
    def unsent_dropped(self) -> int:
        return sum(link.connection.unsent_dropped for link in self.links)

    @property
    def registered(self) -> bool:
        """Loaded, and a broker holds every slot in its ledger."""
        return all(link.registered for link in self.links)

    @property
    def link_beat_at(self) -> float | None:
        """When the slowest link thread last beat (None before all have)."""
        beats = [link.last_beat_at for link in self.links]
        return None if None in beats else min(beats)

    @property
    def link_callback_errors(self) -> int:
        return sum(link.connection.callback_errors for link in self.links)

    def run(self, stop: StopSignal) -> None:
        """Serve every slot's jobs until ``stop`` is set and they have ended.

        Raises:
            EngineLoadError: the model did not load, or its warm-up failed.
        """
        for link in self.links:
            link.start(stop)
        try:
            if self.settings.held:
                log.error("worker %s held: %s; not loading the model",
                          self.name, self.settings.last_failure)
                stop.wait(None)
                return
            self.runner.run(stop)
        finally:
            stop.set()
            for link in self.links:
                link.connection.join(
                    timeout_s=self.settings.heartbeat_interval_s * 3)
            self.runner.close()
            log.info("worker %s (%d slots) stopped after %d jobs", self.name,
                     len(self.links), self.runner.jobs_done)
