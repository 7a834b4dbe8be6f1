"""Hop tracing for ``tests/bench/bench_ttft_hops.py``: nothing unless
``LLAMAPOOL_HOP_TRACE`` is set.

Every llamapool process started with this directory first on ``PYTHONPATH``
imports this at start-up (Python's ``sitecustomize`` hook). With
``LLAMAPOOL_HOP_TRACE=PREFIX`` it wraps a few functions on a request's path,
as their modules are imported, so that each call appends
``name perf_counter`` to ``PREFIX.<pid>`` (``perf_counter`` is
CLOCK_MONOTONIC on Linux: one clock for every process). No llamapool code
knows about it, and nothing changes when the variable is unset.

Each record costs a few microseconds (a buffered write); the benchmark
reports it beside the figures.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
import time

PREFIX = os.environ.get("LLAMAPOOL_HOP_TRACE")

#: module -> [(qualified function name, when, label)]; ``when`` is "in"
#: (entry) or "out" (return). A label ending in "." gets the name of the
#: message class of the call's first argument (or of ``frames[1]``).
POINTS = {
    "llamapool.http_worker": [
        ("FullRequestThreadWorker._on_readable", "in", "http.readable"),
        ("FullRequestThreadWorker._hand_to_thread", "in", "http.whole"),
        ("FullRequestThreadWorker.handle_request", "in", "http.request")],
    "gunicorn.workers.gthread": [("ThreadWorker.handle", "in", "http.thread")],
    "gunicorn.http.wsgi": [("Response.write", "out", "http.write")],
    "falcon.app": [("App.__call__", "out", "falcon.out")],
    "frontend.app": [("GenerationResource.on_post", "in", "responder.in"),
                     ("GenerationResource.on_post", "out", "responder.out")],
    "frontend.prompt_gate": [("PromptGate.check", "in", "gate.in"),
                             ("PromptGate.check", "out", "gate.out")],
    "frontend.broker_link": [("BrokerLink.submit", "in", "submit.in"),
                             ("JobStream.put", "in", "put."),
                             ("JobStream.get", "out", "stream.got")],
    "frontend.sse": [("EventStreamBody.__next__", "out", "sse.chunk")],
    "protocol.link": [("BrokerConnection.send", "in", "send."),
                      ("BrokerConnection._write", "in", "write."),
                      ("BrokerConnection._receive", "in", "link.recv")],
    "workers.broker.broker": [("Broker._drain", "in", "broker.drain"),
                              ("Broker.to_worker", "in", "broker.to_worker"),
                              ("Broker._relay_token", "in", "broker.relay")],
    # The broker's SUBMIT handler (issue 30: a slot of the job's model).
    "workers.broker.admission": [("SubmitAdmission.on_submit", "in",
                                  "broker.submit.in")],
    "workers.model.worker_link": [("WorkerLink.on_message", "in", "worker.msg.")],
    "workers.model.job_runner": [("JobRunner._run_job", "in", "worker.picked")],
    "workers.model.active_job": [("ActiveJob.emit", "in", "worker.emit")],
    "workers.model.prompt_reuse": [("PromptReuse.prepare", "out",
                                    "worker.prepared")],
}

_out = None
_lock = threading.Lock()


def _record(label: str) -> None:
    global _out
    line = f"{label} {time.perf_counter():.7f}\n"
    # A text file's writes are not thread-safe (TextIOWrapper keeps its own
    # pending buffer), and a worker's two threads both record: unlocked,
    # their records interleaved into corrupt lines.
    with _lock:
        if _out is None:
            _out = open(f"{PREFIX}.{os.getpid()}", "a", buffering=1 << 16)
        _out.write(line)


def _message_name(args) -> str:
    if not args:
        return "?"
    first = args[0]
    if type(first).__name__ == "Outgoing":  # a worker's frame, tagged with its job
        first = first.message
    if isinstance(first, list) and len(first) > 1:  # frames
        from protocol import messages
        cls = messages.command_class(first)
        return cls.__name__ if cls else "?"
    return type(first).__name__


def _wrap(fn, when: str, label: str):
    @functools.wraps(fn)
    def traced(self, *args, **kwargs):
        name = label + _message_name(args) if label.endswith(".") else label
        if when == "in":
            _record(name)
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            _record(name)
    return traced


def _patch(module) -> None:
    for qualname, when, label in POINTS[module.__name__]:
        cls_name, fn_name = qualname.split(".")
        cls = getattr(module, cls_name)
        setattr(cls, fn_name, _wrap(getattr(cls, fn_name), when, label))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a traced module once it has been executed."""

    def find_spec(self, name, path, target=None):
        if name not in POINTS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


def _flush_at_exit() -> None:
    if _out is not None:
        _out.flush()


if PREFIX:
    import atexit

    sys.meta_path.insert(0, _AfterImport())
    atexit.register(_flush_at_exit)
