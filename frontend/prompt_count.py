"""Counting a request's prompt tokens without generating: Anthropic's
``/v1/messages/count_tokens``, OpenAI's ``/v1/responses/input_tokens`` and
llama-server's ``/v1/chat/completions/input_tokens``.

The count is the prompt gate's (``frontend.prompt_gate``): the very tokens a
generation with the same body would submit, rendered by the same template
and tokenised by the same code, so it equals the prompt tokens that
generation's usage reports. A frontend with the vocabulary counts without a
slot or a worker. One without it (no ``--model``) asks a worker, through the
request pipeline of any job (``frontend.endpoint``): a job of no tokens to
generate, which the worker renders and tokenises and ends before any decode
(its FINAL's usage is the count). That takes a slot for the time of
tokenising, and a full pool is a 503, as for any job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import falcon

from frontend import openai_schema
from frontend.client_socket import client_gone
from frontend.endpoint import JobEndpoint, Submission
from frontend.generation import collect
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.native_api import NO_VOCAB, NotSupported
from frontend.reasoning import with_thinking
from frontend.request_body import read_json_body
from frontend.settings import FrontendSettings
from frontend.vocabularies import Vocabularies
from protocol.payloads import GenerationRequest


@dataclasses.dataclass(frozen=True)
class CountRequest:
    """A prompt to count by a worker: ``generation`` has nothing to
    generate."""

    generation: GenerationRequest
    model: str | None = None


class PromptCountResource(JobEndpoint[CountRequest]):
    """``POST``: ``answer(n)`` for the prompt ``parse(body)`` describes.

    Args:
        settings: the frontend's (the body's size limit).
        vocabs: the frontend's vocabularies, or None (then a worker counts).
        parse: the API's counting parser (400 naming a bad field): the
            prompt's job, and the API's thinking switch (None: not given).
        answer: the API's answer for a count of ``n`` tokens.
        link: the broker, for a worker to count when there is no gate
            (None: 501 naming the setting).
    """

    def __init__(self, settings: FrontendSettings, vocabs: Vocabularies | None,
                 parse: Callable[[Any], tuple[GenerationRequest, bool | None]],
                 answer: Callable[[int], dict],
                 link: BrokerClient | None = None) -> None:
        super().__init__(link, settings, vocabs)
        self.parse_count = parse
        self.answer = answer

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json_body(req, self.settings.max_body_bytes)
        if self.vocabs:
            generation, thinking = self.parse_count(body)
            # The named model's vocabulary (an unknown model is 404); a
            # model the frontend has none of is counted by its worker.
            model = (self.models.resolve(_asked_model(body))
                     if self.link is not None else "")
            gate = self.door_gate(dataclasses.replace(generation, model=model))
            if gate is not None:
                counted = gate.check(with_thinking(gate, generation, thinking))
                resp.media = self.answer(len(counted.prompt_tokens))
                return
        if self.link is None:
            raise NotSupported(NO_VOCAB)
        self.handle(req, resp, body)  # a worker counts

    # --- a worker's count (``JobEndpoint``) ------------------------------------

    def parse(self, body: Any) -> CountRequest:
        generation, thinking = self.parse_count(body)
        # No vocabulary here: the template's own thinking default holds.
        generation = with_thinking(None, generation, thinking)
        return CountRequest(dataclasses.replace(generation, max_tokens=0),
                            _asked_model(body))

    def admit(self, parsed: CountRequest, body: Any) -> Submission[CountRequest]:
        return Submission(parsed, parsed.generation, stream=False)

    def respond(self, req: falcon.Request, resp: falcon.Response,
                submission: Submission[CountRequest], job: Job) -> None:
        _, final, _ = collect(job, lambda: client_gone(req))
        resp.media = self.answer(final.usage.prompt_tokens)


def _asked_model(body: Any) -> str | None:
    """The body's ``model``, for the pool's resolution (which refuses a bad
    one); None when it names none."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _chat_count(body: Any) -> tuple[GenerationRequest, bool | None]:
    """The whole chat body, checked as ``/v1/chat/completions`` checks it
    (llama-server parses it with the chat endpoint's own parser too); its
    thinking switch is in ``chat_template_kwargs``, already in the job."""
    return openai_schema.parse_chat(body).generation, None


def chat_input_tokens(n: int) -> dict:
    """llama-server's answer (``handle_count_tokens`` for an OpenAI body):
    OpenAI's Responses shape, which llama-server uses for chat too."""
    return {"object": "response.input_tokens", "input_tokens": n}


def add_chat_count_routes(app, link: BrokerClient, settings: FrontendSettings,
                          vocabs: Vocabularies | None) -> None:
    """``POST /v1/chat/completions/input_tokens`` and
    ``/chat/completions/input_tokens`` (llama-server's paths)."""
    resource = PromptCountResource(settings, vocabs, _chat_count, chat_input_tokens,
                                   link)
    for prefix in ("/v1", ""):
        app.add_route(f"{prefix}/chat/completions/input_tokens", resource)
