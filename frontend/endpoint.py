"""One request pipeline for every endpoint whose answer is a job on a slot.

``POST /v1/completions``, ``/v1/chat/completions``, the native
``/completion`` and ``/infill``, and the embeddings routes all answer the
same way, and once each wrote it out by hand. ``JobEndpoint.on_post`` is now
the one copy, in the order in which its errors win:

1. the body, bounded (``read_json_body``: 413, or 400 for bad JSON),
   and a client that has already left (``frontend.client_socket``: the
   answer is a 499 nobody reads), checked again before step 5;
2. ``parse``: the endpoint's own parser (400 naming the field);
3. ``admit``: the prompt gate, which counts the prompt's tokens at the door
   (400 for one that cannot fit) and says what is submitted (a
   ``Submission``), then ``scoped``: the job's cache tenant, from the key
   and the ``cache_salt`` (``frontend.cache_scope``);
4. the request's log record learns whether it streams;
5. submit (``frontend.generation.start_job_steps``: 503 + Retry-After when every
   slot is busy, 502/504 for the pool's failures, before anything is sent),
   then the answer's headers and the record's slot, written here; a
   streamed job that the broker queues is answered at once and waits in
   its body (``frontend.queued_stream``);
6. ``respond``: collect the job or stream it.

A text endpoint subclasses ``GenerationEndpoint`` and writes ``parse`` and
``shaper`` (an ``frontend.interfaces.Shaper``), and ``admit`` when its
prompt needs more than the gate; step 6 is then done for it, whole
(``collect``) or as SSE (``frontend.sse``). An endpoint with another answer
(embeddings) subclasses ``JobEndpoint`` and writes ``respond``.

The job layer (``frontend.job``, ``frontend.generation``) writes no header
and no log field: it returns the job, and this module writes them.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any, Generic, Protocol, TypeVar

import falcon

from frontend.auth import presented_key
from frontend.cache_scope import CacheScope
from frontend.client_socket import client_gone
from frontend.errors import BadRequest, ClientGone
from frontend.generation import collect, start_job_steps
from frontend.interfaces import BrokerClient, JobOrigin, Shaper
from frontend.job import Job, run_steps
from frontend.key_records import startup_digests
from frontend.lease import LeaseEnding
from frontend.model_resolution import ModelResolver
from frontend.prompt_gate import PromptGate
from frontend.queued_stream import JobSteps, QueuedStreamBody, first_step
from frontend.request_body import read_json_body
from frontend.request_log import RequestRecord
from frontend.settings import FrontendSettings
from frontend.sse import stream_answer, stream_body
from frontend.tracing import traced_gate_check, traced_parse
from frontend.vocabularies import Vocabularies
from protocol.broker_list import split_endpoints
from protocol.payloads import GenerationRequest, KeyPolicy


class TextRequest(Protocol):
    """What ``GenerationEndpoint.admit`` reads of a parsed text request."""

    @property
    def generation(self) -> GenerationRequest:
        ...

    @property
    def stream(self) -> bool:
        ...


#: The endpoint's parsed request, whatever its parser returns.
Parsed = TypeVar("Parsed")
#: ... and a text endpoint's, which has a generation and says if it streams.
ParsedText = TypeVar("ParsedText", bound=TextRequest)

#: The model name answered when no one named one.
DEFAULT_MODEL_NAME = "llamapool"


@dataclasses.dataclass(frozen=True)
class Submission(Generic[Parsed]):
    """What ``admit`` hands on: the parsed request, and the job it becomes.

    Args:
        parsed: the parser's result, for ``respond`` and ``shaper``.
        generation: what goes to a worker, prompt tokens counted if the
            gate could.
        stream: answer with SSE events.
        id_slot: llama.cpp's ``id_slot``: that one slot, or -1 for any.
        n_prompt: the prompt's token count if the door counted it (0: the
            worker counts), for an answer that shows it before FINAL.
        prompt_text: the prompt, for an answer that echoes it (llama.cpp's).
    """

    parsed: Parsed
    generation: GenerationRequest
    stream: bool = False
    id_slot: int = -1
    n_prompt: int = 0
    prompt_text: str = ""


#: The request header that caps its wait for a slot (seconds), where the
#: broker lets jobs wait (``--queue-max``).
MAX_WAIT_HEADER = "X-Max-Wait-S"


def max_wait_s(req: falcon.Request) -> float:
    """The request's ``X-Max-Wait-S`` (0: none given: the broker's timeout).

    Raises:
        BadRequest: not a number of seconds >= 0.
    """
    raw = req.get_header(MAX_WAIT_HEADER)
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise BadRequest(f"'{MAX_WAIT_HEADER}' must be a number of seconds >= 0",
                         param=MAX_WAIT_HEADER)
    return value


class JobEndpoint(abc.ABC, Generic[Parsed]):
    """``on_post`` for an endpoint that runs one job: see the module's steps.

    Args:
        link: the broker (one link, or a pool of them).
        settings: the frontend's.
        vocabs: the vocabularies this frontend holds (``door_gate``), or None
            when it has none (the worker then counts, and refuses an
            over-long prompt).
    """

    def __init__(self, link: BrokerClient, settings: FrontendSettings,
                 vocabs: Vocabularies | None = None) -> None:
        self.link = link
        self.settings = settings
        self.vocabs = vocabs
        self.cache_scope = CacheScope(settings.cache_scope, settings.api_keys,
                                      startup_digests(settings.keys_file))
        #: The request's ``model`` to the pool's model (issue 30).
        self.models = ModelResolver(link, settings)
        #: The brokers a named key's limits are shared between.
        self._brokers = len(split_endpoints(settings.broker_endpoint))

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.handle(req, resp, read_json_body(req, self.settings.max_body_bytes))

    def handle(self, req: falcon.Request, resp: falcon.Response, body: Any) -> None:
        """The request whose body was read: parse, admit, submit, respond."""
        # The door's checks (a grammar's, the prompt's tokens) and a SUBMIT
        # are spent only on a client that is still there.
        self.refuse_if_gone(req)
        parsed = traced_parse(self.parse, body)
        # Before the gate, which counts for its own model only: an unknown
        # model is 404 here, and takes no slot.
        model = self.models.resolve(getattr(parsed, "model", None))
        submission = self.scoped(
            req, self.admit(with_model(parsed, model), body), model)
        record: RequestRecord = req.context.record
        record.model = self.models.label(model)
        record.stream = submission.stream
        record.key_suffix = req.context.get("key_suffix", "-")
        self.refuse_if_gone(req)
        steps = self.job_steps(req, submission, record)
        if submission.stream:
            job, waiting = first_step(steps)
            if waiting:
                # The broker queued it: a stream answers now, and says it
                # waits (frontend.queued_stream).
                self.respond_waiting(req, resp, submission, steps, job)
                return
        else:
            job = run_steps(steps)
        self.name_slot(job, record, resp)
        try:
            self.respond(req, resp, submission, job)
        except BaseException:
            # Before a body or ``collect`` took the job (a no-op after).
            job.end(LeaseEnding.LOCAL_ERROR)
            raise

    # --- what an endpoint writes ------------------------------------------------

    @abc.abstractmethod
    def parse(self, body: Any) -> Parsed:
        """The body (any JSON value), checked: raise ``BadRequest`` naming a
        bad field."""

    @abc.abstractmethod
    def admit(self, parsed: Parsed, body: Any) -> Submission[Parsed]:
        """The prompt gate (``gated``), and what is submitted."""

    @abc.abstractmethod
    def respond(self, req: falcon.Request, resp: falcon.Response,
                submission: Submission[Parsed], job: Job) -> None:
        """Answer from the started job, which this method owns: hand it to a
        response body, or read it to its end."""

    # --- the pipeline's own steps -----------------------------------------------

    @staticmethod
    def refuse_if_gone(req: falcon.Request) -> None:
        if client_gone(req):
            raise ClientGone()

    def gated(self, generation: GenerationRequest) -> GenerationRequest:
        """``generation`` with its prompt tokens (``PromptGate.check``), or as
        it is without a gate."""
        gate = self.door_gate(generation)
        return (generation if gate is None
                else traced_gate_check(gate, generation))

    def door_gate(self, generation: GenerationRequest) -> PromptGate | None:
        """The prompt gate of the job's model (``generation.model``, as the
        pool resolved it); None: this frontend holds no vocabulary of it,
        and its worker counts (``frontend.vocabularies``)."""
        if not self.vocabs:
            return None
        return self.vocabs.gate_for(generation.model, self.models.seen)

    def scoped(self, req: falcon.Request, submission: Submission[Parsed],
               model: str = "") -> Submission[Parsed]:
        """``submission`` in its tenant's cache scope: the parser left the
        client's ``cache_salt`` in ``cache_tenant``, and the tenant id (a
        keyed hash of it and of the key, never the key) replaces it, so no
        other key's cached prompts serve this job (issue 29)."""
        generation = submission.generation
        tenant = self.cache_scope.tenant(presented_key(req.get_header),
                                         generation.cache_tenant)
        return dataclasses.replace(submission, generation=dataclasses.replace(
            generation, cache_tenant=tenant, model=model))

    def respond_waiting(self, req: falcon.Request, resp: falcon.Response,
                        submission: Submission[Parsed], steps: JobSteps,
                        job: Job) -> None:
        """A streamed job the broker queued: by default it waits here, then
        is answered as any (a text endpoint streams the wait)."""
        job = run_steps(steps)
        self.name_slot(job, req.context.record, resp)
        try:
            self.respond(req, resp, submission, job)
        except BaseException:
            job.end(LeaseEnding.LOCAL_ERROR)
            raise

    def job_steps(self, req: falcon.Request, submission: Submission[Parsed],
                  record: RequestRecord) -> JobSteps:
        """Start the job with the frontend's timeouts (a generator of its
        wait for a slot: ``start_job_steps``); the record follows it (its
        outcome, and its lease's end)."""
        s = self.settings
        return start_job_steps(
            self.link, submission.generation,
            submit_timeout_s=s.submit_timeout_s,
            frame_timeout_s=s.frame_timeout_s,
            credit_batch_frames=s.credit_batch_frames,
            merge_frames_max=s.merge_waiting_frames,
            new_outcome=record.expect_job,
            on_release=record.lease_released,
            id_slot=submission.id_slot,
            # For the broker's log lines about the job (issue 29, item 8),
            # and its fair wait for a slot.
            origin=JobOrigin(record.request_id, record.key_suffix,
                             client=self.cache_scope.client(presented_key(req.get_header)),
                             max_wait_s=max_wait_s(req),
                             key_policy=self.key_policy(req)),
            client_gone=lambda: client_gone(req),
        )

    @staticmethod
    def name_slot(job: Job, record: RequestRecord, resp: falcon.Response) -> None:
        """The record's slot, and the answer's headers naming the slot and the
        process that holds the lease (for operators and fault tests)."""
        record.slot_id = job.slot_id
        resp.set_header("X-Slot-Id", str(job.slot_id))
        resp.set_header("X-Frontend-Pid", str(os.getpid()))

    def key_policy(self, req: falcon.Request) -> KeyPolicy | None:
        """A named key's limits, this broker's share of them
        (``frontend.key_records``); None for another key."""
        key_record = req.context.get("key_record")
        if key_record is None:
            return None
        return key_record.policy(self._brokers)

    def model_name(self, job: Job, asked: str | None = None) -> str:
        """The model an answer names: the worker's, else the frontend's
        ``model_name`` (``LLAMAPOOL_MODEL_NAME``), else the client's."""
        return job.model or self.settings.model_name or asked or DEFAULT_MODEL_NAME


def with_model(parsed: Parsed, model: str) -> Parsed:
    """``parsed`` with its generation (where it has one yet) for ``model``,
    so that ``admit`` and the gate see which model the job is for."""
    generation = getattr(parsed, "generation", None)
    if not isinstance(generation, GenerationRequest) or not (
            dataclasses.is_dataclass(parsed)):
        return parsed
    return dataclasses.replace(parsed, generation=dataclasses.replace(
        generation, model=model))


class GenerationEndpoint(JobEndpoint[ParsedText]):
    """A text generation, answered whole or streamed: a subclass writes
    ``parse`` and ``shaper`` (and ``admit`` if need be)."""

    def admit(self, parsed: ParsedText, body: Any) -> Submission[ParsedText]:
        """``parsed.generation`` through the prompt gate, streamed if
        ``parsed.stream``."""
        return Submission(parsed, self.gated(parsed.generation),
                          stream=parsed.stream)

    @abc.abstractmethod
    def shaper(self, req: falcon.Request, submission: Submission[ParsedText],
               job: Job) -> Shaper:
        """The answer's shaper, once the job has a slot and a model."""

    def respond(self, req: falcon.Request, resp: falcon.Response,
                submission: Submission[ParsedText], job: Job) -> None:
        shaper = self.shaper(req, submission, job)
        if submission.stream:
            # From here on the body owns the job, and with it the lease.
            stream_answer(req, resp, job, shaper, self.settings.stream_sndbuf_bytes)
            return
        text, final, entries = collect(job, lambda: client_gone(req))
        resp.media = shaper.whole_answer(text, final, entries)

    def respond_waiting(self, req: falcon.Request, resp: falcon.Response,
                        submission: Submission[ParsedText], steps: JobSteps,
                        job: Job) -> None:
        """Stream the wait, then the job (``frontend.queued_stream``): the
        headers go now, so the slot is named in the request's log only."""
        record: RequestRecord = req.context.record
        resp.set_header("X-Frontend-Pid", str(os.getpid()))

        def started(job: Job) -> None:
            record.slot_id = job.slot_id

        body = QueuedStreamBody(steps, job,
                                lambda job: self.shaper(req, submission, job),
                                started)
        stream_body(req, resp, body, self.settings.stream_sndbuf_bytes)
