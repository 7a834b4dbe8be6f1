"""OpenAI's Responses API, stateless: ``POST /v1/responses`` and
``POST /v1/responses/input_tokens``.

``/v1/responses`` is a chat job like ``/v1/chat/completions``: the same
request pipeline (``frontend.endpoint``), prompt gate, lease and SSE body;
only its parser (``frontend.responses_schema``) and its shaper
(``frontend.responses_format``) are its own. Errors are OpenAI's shape, as
on every OpenAI route.
"""

from __future__ import annotations

from typing import Any

import falcon

from frontend.endpoint import GenerationEndpoint, Submission
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.prompt_count import PromptCountResource
from frontend.reasoning import reasoning_split, with_thinking
from frontend.responses_format import ResponsesShaper
from frontend.responses_schema import (
    ResponsesRequest,
    parse_input_tokens,
    parse_responses,
)
from frontend.settings import FrontendSettings
from frontend.vocabularies import Vocabularies


class ResponsesResource(GenerationEndpoint[ResponsesRequest]):
    """``POST /v1/responses``."""

    def parse(self, body: Any) -> ResponsesRequest:
        return parse_responses(body)

    def admit(self, parsed: ResponsesRequest, body: Any
              ) -> Submission[ResponsesRequest]:
        generation = with_thinking(self.door_gate(parsed.generation),
                                   parsed.generation, parsed.thinking)
        return Submission(parsed, self.gated(generation), stream=parsed.stream)

    def shaper(self, req: falcon.Request,
               submission: Submission[ResponsesRequest], job: Job
               ) -> ResponsesShaper:
        parsed = submission.parsed
        return ResponsesShaper(
            req.context.request_id, self.model_name(job, parsed.model),
            parsed.echo, tools=parsed.tools, single_call=parsed.single_call,
            reasoning=reasoning_split(self.door_gate(submission.generation),
                                      submission.generation))


def add_responses_routes(app: falcon.App, link: BrokerClient,
                         settings: FrontendSettings, vocabs: Vocabularies
                         ) -> None:
    app.add_route("/v1/responses", ResponsesResource(link, settings, vocabs))
    app.add_route("/v1/responses/input_tokens", PromptCountResource(
        settings, vocabs, parse_input_tokens,
        lambda n: {"object": "response.input_tokens", "input_tokens": n}, link))
