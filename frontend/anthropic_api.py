"""Anthropic's Messages API: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

``/v1/messages`` is a chat job like ``/v1/chat/completions``: the same
request pipeline (``frontend.endpoint``), prompt gate, lease and SSE body;
only its parser (``frontend.anthropic_schema``) and its shaper
(``frontend.anthropic_format``) are its own. Its errors, a 401 from the key
check included, are in Anthropic's shape (``anthropic_format.error_shape``,
installed for ``/v1/messages`` by ``frontend.app``). The key may come in
``x-api-key`` (``frontend.auth``); the ``anthropic-version`` and
``anthropic-beta`` headers are accepted and change nothing, since there is
one version of this API here.
"""

from __future__ import annotations

from typing import Any

import falcon

from frontend.anthropic_format import MessagesShaper
from frontend.anthropic_schema import MessagesRequest, parse_count, parse_messages
from frontend.endpoint import GenerationEndpoint, Submission
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.prompt_count import PromptCountResource
from frontend.reasoning import reasoning_split, with_thinking
from frontend.settings import FrontendSettings
from frontend.vocabularies import Vocabularies

#: Where Anthropic's error shape applies.
PATH = "/v1/messages"


class MessagesResource(GenerationEndpoint[MessagesRequest]):
    """``POST /v1/messages``."""

    def parse(self, body: Any) -> MessagesRequest:
        return parse_messages(body)

    def admit(self, parsed: MessagesRequest, body: Any
              ) -> Submission[MessagesRequest]:
        generation = self.gated(with_thinking(self.door_gate(parsed.generation),
                                              parsed.generation, parsed.thinking))
        # ``message_start`` shows the prompt's size when the door counted it.
        return Submission(parsed, generation, stream=parsed.stream,
                          n_prompt=len(generation.prompt_tokens or ()))

    def shaper(self, req: falcon.Request, submission: Submission[MessagesRequest],
               job: Job) -> MessagesShaper:
        parsed = submission.parsed
        return MessagesShaper(
            req.context.request_id, self.model_name(job, parsed.model),
            n_prompt=submission.n_prompt, tools=parsed.tools,
            single_call=parsed.single_call, stop_sequences=parsed.stop_sequences,
            reasoning=reasoning_split(self.door_gate(submission.generation),
                                      submission.generation))


def add_anthropic_routes(app: falcon.App, link: BrokerClient,
                         settings: FrontendSettings, vocabs: Vocabularies
                         ) -> None:
    app.add_route(PATH, MessagesResource(link, settings, vocabs))
    app.add_route(PATH + "/count_tokens", PromptCountResource(
        settings, vocabs, parse_count, lambda n: {"input_tokens": n}, link))
