"""Where the worker's spans hook in; each hook is one attribute read when off.

The spans are ``workers.model.job_trace``'s, imported only once tracing is
on (``protocol.tracing``) and a job's SUBMIT carries a sampled context.
"""

from __future__ import annotations

from typing import Any

from protocol import tracing

#: The traced job the main thread is running (``job_trace.WorkerJobTrace``),
#: for the hooks deep in the engine (``prompt_reuse``); None: none. The
#: worker runs one job at a time, in its main thread (``job_runner``).
current: Any = None


def job_trace(job: Any) -> Any:
    """Start the spans of ``job`` (an ``ActiveJob``) and make it
    ``current``; None when tracing is off or the job is not traced."""
    global current
    if tracing.TRACER is None or job.trace_context is None:
        return None
    from workers.model.job_trace import WorkerJobTrace
    current = WorkerJobTrace.start(job)
    return current


def job_ended() -> None:
    """The main thread's job is over: no hook may note into its trace."""
    global current
    current = None
