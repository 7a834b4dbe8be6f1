"""The Falcon app: ``create_app(settings)`` builds it and has no side effects.

The broker link starts lazily on the first request that needs it, which is
after gunicorn has forked this process.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

import falcon

from frontend import anthropic_api, metrics, openai_schema, tracing
from frontend.anthropic_format import error_shape as anthropic_error_shape
from frontend.auth import ApiKeyMiddleware
from frontend.broker_link import BrokerLink
from frontend.broker_pool import BrokerPool
from frontend.cors import (
    HostCheckMiddleware,
    OriginCheckMiddleware,
    cors_policy,
)
from frontend.embeddings import EmbeddingsResource
from frontend.endpoint import DEFAULT_MODEL_NAME, GenerationEndpoint, Submission
from frontend.errors import (
    Unavailable,
    install_error_handlers,
    write_error,
)
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.key_records import KeyRecords
from frontend.model_resolution import catalog
from frontend.native_api import add_native_routes
from frontend.openai_format import ResponseShaper
from frontend.probes import add_probe_routes
from frontend.prompt_count import add_chat_count_routes
from frontend.reasoning import reasoning_split
from frontend.request_log import RequestLogMiddleware
from frontend.rerank_api import add_rerank_routes
from frontend.responses_api import add_responses_routes
from frontend.settings import FrontendSettings
from frontend.slot_actions import add_slot_action_routes
from frontend.vocabularies import Vocabularies
from frontend.web_page import add_page_routes
from protocol.broker_list import split_endpoints
from protocol.curve import client_keys
from protocol.errors import ErrorCode
from protocol.payloads import JobProgress, ModelStatus, PoolStatus, SlotStatus

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdMiddleware:
    """Honours a well-formed incoming X-Request-Id, else makes one."""

    def process_request(self, req, resp) -> None:
        incoming = req.get_header("X-REQUEST-ID")
        req.context.request_id = (
            incoming if incoming and _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        )
        resp.set_header("X-Request-Id", req.context.request_id)


class GenerationResource(GenerationEndpoint[openai_schema.ParsedRequest]):
    """``POST /v1/completions`` (``kind="completion"``) and
    ``POST /v1/chat/completions`` (``kind="chat"``)."""

    def __init__(self, kind: str, link: BrokerClient,
                 settings: FrontendSettings, vocabs: Vocabularies) -> None:
        super().__init__(link, settings, vocabs)
        self.kind = kind
        self._parse = (openai_schema.parse_chat if kind == "chat"
                       else openai_schema.parse_completion)

    def parse(self, body: Any) -> openai_schema.ParsedRequest:
        return self._parse(body)

    def shaper(self, req: falcon.Request,
               submission: Submission[openai_schema.ParsedRequest],
               job: Job) -> ResponseShaper:
        parsed = submission.parsed
        return ResponseShaper(
            self.kind,
            req.context.request_id,
            self.model_name(job, parsed.model),
            parsed.include_usage,
            parsed.logprobs,
            tools=parsed.tools,
            reasoning=reasoning_split(self.door_gate(submission.generation),
                                      submission.generation,
                                      parsed.reasoning_format)
            if self.kind == "chat" else None,
        )


class LedgerView:
    """Base for responders that show the broker's ledger.

    One STATUS round trip, never longer than ``health_timeout_s``: under load
    a health check must stay cheap and bounded (llama.cpp once had to move busy
    state out of ``/health`` because checks timed out).
    """

    def __init__(self, link: BrokerClient, settings: FrontendSettings):
        self.link = link
        self.settings = settings

    def ledger(self, resp: falcon.Response, max_age_s: float = 0.0
               ) -> PoolStatus | None:
        """The broker's snapshot, or None after answering 503 for it."""
        status = self.link.status(self.settings.health_timeout_s, max_age_s)
        if status is None:
            write_error(resp, Unavailable(ErrorCode.BROKER_UNREACHABLE,
                                          "broker unreachable"))
        return status


class ModelsResource(LedgerView):
    """``GET /v1/models``: each model the live workers serve, once, with its
    aliases, capabilities and slots (``frontend.model_resolution.catalog``)."""

    def on_get(self, req, resp) -> None:
        status = self.link.status(self.settings.health_timeout_s,
                                  self.settings.health_cache_s)
        slots = status.slots if status is not None else []
        engines = {}
        for slot in slots:
            engines.setdefault(slot.model, slot.engine)
        models = [model_entry(m, engines[m.name]) for m in catalog(status).values()]
        if not models and self.settings.model_name:
            name = self.settings.model_name
            models = [{"id": name, "object": "model", "created": 0,
                       "owned_by": "llamapool"}]
        resp.media = {"object": "list", "data": models}


def model_entry(model: ModelStatus, engine: str) -> dict:
    """One ``/v1/models`` entry: OpenAI's four fields, llama-server's
    router's ``aliases``, and the pool's ``capabilities`` and slots."""
    return {
        "id": model.name, "object": "model", "created": 0,
        "owned_by": "llamapool", "aliases": list(model.aliases),
        "capabilities": list(model.capabilities),
        "meta": {"n_ctx": model.n_ctx, "engine": engine,
                 # Every slot of it, loading ones too (as before issue 30).
                 "slots": model.slots_total + model.slots_loading,
                 "slots_total": model.slots_total,
                 "slots_idle": model.slots_idle,
                 "slots_busy": model.slots_busy,
                 "slots_loading": model.slots_loading},
    }


class HealthResource(LedgerView):
    """``GET /health``: 200 once a worker is loaded, 503 while none is: with
    the workers' failures when they died (``failing``), so an operator sees
    a crash loop instead of "Loading model" forever."""

    def on_get(self, req, resp) -> None:
        status = self.ledger(resp, self.settings.health_cache_s)
        if status is None:
            return
        failing = failing_workers(status)
        if status.slots_total == 0:
            if failing:
                write_error(resp, Unavailable(
                    ErrorCode.WORKERS_FAILING,
                    "no worker can start: " + "; ".join(
                        f"{f['worker']}: {f['failure']}" for f in failing)))
            else:
                write_error(resp, Unavailable(ErrorCode.LOADING_MODEL,
                                              "Loading model"))
            return
        resp.media = {
            "status": "ok",
            "slots_idle": status.slots_free,
            "slots_processing": status.slots_total - status.slots_free,
            **({"failing": failing} if failing else {}),
        }


def failing_workers(status: PoolStatus) -> list[dict]:
    """The workers that died and are restarting or held, and why."""
    return [{"worker": slot.worker_name, "host": slot.host, "state": slot.state,
             "failure": slot.failure}
            for slot in status.slots if slot.failure]


class MetricsResource(LedgerView):
    """``GET /metrics``: Prometheus text, this host's and the pool's.

    Without the broker it still answers 200 with this host's own series.
    """

    def on_get(self, req, resp) -> None:
        snapshot = self.link.status(self.settings.health_timeout_s)
        resp.data = metrics.render(snapshot)
        resp.content_type = metrics.CONTENT_TYPE
        if snapshot is not None:
            # llama.cpp's header: when the counters began (a reset before it).
            resp.set_header("Process-Start-Time-Unix",
                            str(int(snapshot.stats.started_at_unix)))


class SlotsResource(LedgerView):
    """``GET /slots``: every slot in the pool, from the broker's ledger.

    Progress fields come with the workers' heartbeats, so they lag by up to
    one heartbeat interval.
    """

    def on_get(self, req, resp) -> None:
        status = self.ledger(resp)
        if status is None:
            return
        # Grouped by model, in slot order within each (one model: slot order).
        resp.media = [public_slot(slot) for slot in
                      sorted(status.slots, key=lambda s: (s.model, s.id))]


class QueueResource(LedgerView):
    """``GET /queue``: the jobs waiting for a slot (the broker's
    ``--queue-max``), in all and per named key (``--keys-file``), with the
    Retry-After a refusal would carry now. Counts only: no prompt, no key."""

    def on_get(self, req, resp) -> None:
        status = self.ledger(resp)
        if status is None:
            return
        resp.media = {
            "waiting": status.jobs_waiting,
            "retry_after_s": status.retry_after_s,
            "keys": [{"key": k.name, "waiting": k.waiting, "running": k.running}
                     for k in status.keys if k.waiting or k.running],
        }


#: What ``/slots`` shows for a slot with no progress yet (idle, or its job's
#: first heartbeat has not arrived).
_NO_PROGRESS = JobProgress(job_id="")


def public_slot(slot: SlotStatus) -> dict:
    """One ``/slots`` entry, llama.cpp-style names. Never any prompt text: the
    broker does not have it."""
    progress = slot.progress or _NO_PROGRESS
    return {
        "id": slot.id,
        "state": slot.state,
        "is_processing": slot.state in ("busy", "cancelling"),
        "id_task": slot.id_task,
        "host": slot.host,
        "pid": slot.pid,
        "model": slot.model,
        "engine": slot.engine,
        "n_ctx": slot.n_ctx,
        "n_prompt_tokens": progress.n_prompt,
        "n_decoded": progress.n_generated,
        "tokens_per_second": progress.tokens_per_s,
        "kv_cache_tokens": progress.n_ctx_used,
        # Paused because the client is not reading: the stall timeout ends
        # the job in this many seconds unless it reads again (None: not paused).
        "pause_ends_in_s": progress.pause_ends_in_s,
        # llama.cpp threads the job decodes with now (0: idle, or not known);
        # changes mid-job under --threads auto.
        "n_threads": progress.n_threads,
        "lease_taken_at": slot.lease_taken_at,
        # The broker's own count, so a browser with a skewed clock shows
        # the right age (the web page's pool view).
        "lease_age_s": slot.lease_age_s,
        "jobs_served": slot.jobs_served,
        # The worker's saved prompt states: count, bytes used, limit, hits...
        # (None: it has not reported, e.g. the synthetic engine).
        "prompt_cache": None if slot.prompt_cache is None
        else dataclasses.asdict(slot.prompt_cache),
        # Where the model's layers are: GPU layers asked and really offloaded
        # (0 on a CPU build), and the devices the worker sees.
        "gpu": None if slot.gpu is None else dataclasses.asdict(slot.gpu),
        # Whether llama.cpp repacked the weights, and why (--repack).
        "repack": slot.repack,
        # How the worker's last run died, while it restarts ("loading") or
        # after its supervisor held it ("failed"); "" otherwise.
        "failure": slot.failure,
    }


class LlamapoolApp(falcon.App):
    """A Falcon app that also exposes its broker link (for hooks and tests)."""

    link: BrokerClient
    vocabs: Vocabularies
    #: Read by the gunicorn worker too (``llamapool.http_worker``).
    settings: FrontendSettings

    def warm_up(self) -> None:
        """Connect to the broker and load the tokenizer before the first
        request (gunicorn's ``post_worker_init``), so it does not pay for it."""
        self.link.start()
        self.vocabs.load()


def broker_links(settings: FrontendSettings) -> BrokerClient:
    """One link to the broker, or a ``BrokerPool`` over several."""
    curve = client_keys(settings.curve_server_key, settings.curve_secret_key)
    links = [
        BrokerLink(endpoint,
                   heartbeat_interval_s=settings.heartbeat_interval_s,
                   heartbeat_liveness=settings.heartbeat_liveness,
                   curve=curve)
        for endpoint in split_endpoints(settings.broker_endpoint)
    ]
    return links[0] if len(links) == 1 else BrokerPool(links)


def create_app(
    settings: FrontendSettings, link: BrokerClient | None = None
) -> LlamapoolApp:
    """Build the WSGI app. ``link`` may be injected by tests."""
    link = link or broker_links(settings)
    cors = cors_policy(settings)
    app = LlamapoolApp(
        middleware=[
            # First, so that its process_response tags every answer, a 401
            # from the key check included (``frontend.cors``); none when no
            # origin is allowed (a keyless pool, by default).
            *([cors] if cors is not None else []),
            RequestIdMiddleware(),
            RequestLogMiddleware(),
            # The request's span (none when tracing is off: ``frontend.tracing``).
            *tracing.middleware(),
            # Which pages may use the pool (``frontend.cors``): refused
            # before the key check and anything else, and logged.
            HostCheckMiddleware(settings.allowed_hosts),
            OriginCheckMiddleware(settings.web_origins()),
            tracing.traced_auth(ApiKeyMiddleware(
                settings.api_keys,
                KeyRecords(settings.keys_file) if settings.keys_file else None)),
        ],
        cors_enable=False,  # the middleware above, configured, instead
    )
    app.req_options.strip_url_path_trailing_slash = True
    install_error_handlers(
        app, refused_model=settings.model_name or DEFAULT_MODEL_NAME,
        # Anthropic's clients read its own error shape (a 401 included).
        shapes=((anthropic_api.PATH, anthropic_error_shape),))
    # The prompt gates: one per model this frontend has the file of.
    vocabs = Vocabularies(settings)
    completions = GenerationResource("completion", link, settings, vocabs)
    chat = GenerationResource("chat", link, settings, vocabs)
    models = ModelsResource(link, settings)
    health = HealthResource(link, settings)
    for prefix in ("", "/v1"):
        app.add_route(f"{prefix}/completions", completions)
        app.add_route(f"{prefix}/chat/completions", chat)
        app.add_route(f"{prefix}/models", models)
        app.add_route(f"{prefix}/health", health)
    app.add_route("/v1/embeddings", EmbeddingsResource(link, settings, native=False))
    native_embeddings = EmbeddingsResource(link, settings, native=True)
    app.add_route("/embeddings", native_embeddings)
    app.add_route("/embedding", native_embeddings)  # llama.cpp's older name
    add_rerank_routes(app, link, settings)
    add_native_routes(app, link, settings, vocabs)
    anthropic_api.add_anthropic_routes(app, link, settings, vocabs)
    add_responses_routes(app, link, settings, vocabs)
    add_chat_count_routes(app, link, settings, vocabs)
    app.add_route("/slots", SlotsResource(link, settings))
    add_slot_action_routes(app, link, settings)
    app.add_route("/queue", QueueResource(link, settings))
    app.add_route("/metrics", MetricsResource(link, settings))
    add_probe_routes(app, link, settings)
    add_page_routes(app)
    app.link = link
    app.vocabs = vocabs
    app.settings = settings
    return app
