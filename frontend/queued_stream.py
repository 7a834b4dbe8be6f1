"""A streamed request whose job waits in the broker's queue (``--queue-max``).

Without a queue a job either starts or is refused before anything is sent,
so its errors are HTTP statuses. A job that waits for a slot may wait
minutes, and a proxy in front times a silent response out (nginx after 60
s), and the client sees nothing of its progress. So a streamed job that the
broker queues (QUEUED) is answered at once: 200 and ``text/event-stream``,
then an SSE comment line for each step of its wait, which every SSE client
ignores (the OpenAI and Anthropic SDKs included) and the web page shows::

    : waiting, position 3

``position`` counts from 1 (1: next in line), in arrival order (the fair
rule may serve a job sooner); the broker says it again when it changes, and
the job repeats it every ``frontend.job.WAITING_REMINDER_S`` without news.
Once the job has its slot, the stream is the job's events, as for any
stream (``frontend.sse.EventStreamBody``). A wait that ends without a slot
(past its deadline, or the pool's failure) ends the stream with the API's
error event instead of a 503, since the status was sent: its message says
when to retry. A client that leaves while it waits ends the lease as a
disconnect, whose CANCEL takes the job out of the queue (nothing runs for
it), as before the stream answered.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from frontend.errors import ApiError, ClientGone, NoSlotAvailable, PoolError
from frontend.interfaces import Shaper
from frontend.job import Job
from frontend.lease import LeaseEnding
from frontend.sse import EventStreamBody
from protocol.errors import ErrorCode

#: ``frontend.generation.start_job_steps``: yields the waiting job, returns
#: the started one.
JobSteps = Generator[Job, None, Job]


def first_step(steps: JobSteps) -> tuple[Job, bool]:
    """The job and whether it waits in the queue (False: it has started)."""
    try:
        return next(steps), True
    except StopIteration as done:
        return done.value, False


def waiting_comment(job: Job) -> bytes:
    """The SSE comment line for a job's place in the queue."""
    position = job.queued.position + 1 if job.queued is not None else 0
    return f": waiting, position {position}\n\n".encode()


class QueuedStreamBody:
    """The SSE body of a job that waits for its slot (module doc), then of
    the job. It owns the wait, and then the job and its lease.

    Args:
        steps: the rest of the job's start (``first_step`` took one step).
        job: the job as it waits (its lease held, ``queued`` set).
        shaper: the answer's shaper for a job (a waiting one, for an error).
        started: hears the job once it has its slot.
    """

    def __init__(self, steps: JobSteps, job: Job,
                 shaper: Callable[[Job], Shaper],
                 started: Callable[[Job], None]) -> None:
        self._steps = steps
        self._job = job
        self._shaper = shaper
        self._started = started
        self._events: EventStreamBody | None = None
        self._next_comment: bytes | None = waiting_comment(job)
        self._done = False
        self.outcome = job.outcome

    def __iter__(self) -> QueuedStreamBody:
        return self

    def __next__(self) -> bytes:
        if self._events is not None:
            return next(self._events)
        if self._done:
            raise StopIteration
        if self._next_comment is not None:
            comment, self._next_comment = self._next_comment, None
            return comment
        try:
            # A job retried after its worker died may wait again: a new job.
            self._job = next(self._steps)
            return waiting_comment(self._job)
        except StopIteration as done:
            started = done.value
        except ClientGone:
            self._done = True  # the lease ended as a disconnect: nobody reads
            raise StopIteration from None
        except ApiError as exc:
            self._done = True
            return self._error_event(exc)
        except BaseException:
            self._done = True
            self._job.end(LeaseEnding.LOCAL_ERROR)
            raise
        return self._start(started)

    def _start(self, job: Job) -> bytes:
        """The job has its slot: from here on its events, and its lease, are
        an ``EventStreamBody``'s."""
        self._job = job
        try:
            self._started(job)
            self._events = EventStreamBody(job, self._shaper(job))
        except BaseException:
            self._done = True
            job.end(LeaseEnding.LOCAL_ERROR)
            raise
        return next(self._events)

    def _error_event(self, exc: ApiError) -> bytes:
        """The error the wait ended with, as the API's terminating event."""
        message = exc.message
        if isinstance(exc, NoSlotAvailable):
            seconds = max(1, int(round(exc.retry_after_s)))
            message = f"{message}; retry after {seconds} s"
        code = (exc.domain_code if isinstance(exc, PoolError)
                else exc.code or ErrorCode.NO_SLOT)
        return self._shaper(self._job).error_event(code, message)

    def close(self) -> None:
        """Called by the WSGI server after the last write or a failed one."""
        self._done = True
        if self._events is not None:
            self._events.close()
            return
        # Still waiting: CANCEL takes it out of the broker's queue.
        self._job.end(LeaseEnding.DISCONNECT)
        self._steps.close()

    def __del__(self) -> None:
        if getattr(self, "_events", None) is None and hasattr(self, "_job"):
            self._job.end(LeaseEnding.GC)
