"""Counting a request's prompt tokens without a slot: Anthropic's
``/v1/messages/count_tokens`` and OpenAI's ``/v1/responses/input_tokens``.

The count is the prompt gate's (``frontend.prompt_gate``): the very tokens a
generation with the same body would submit, rendered by the same template
and tokenised by the same code, so it equals the prompt tokens that
generation's usage reports. It needs the frontend's vocabulary; a frontend
started without the model file answers 501 naming the setting, as the
native tokenizer endpoints do, rather than spending a worker on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from frontend.native_api import NO_VOCAB, NotSupported
from frontend.prompt_gate import PromptGate
from frontend.reasoning import with_thinking
from frontend.request_body import read_json_body
from frontend.settings import FrontendSettings
from protocol.payloads import GenerationRequest


class PromptCountResource:
    """``POST``: ``answer(n)`` for the prompt ``parse(body)`` describes.

    Args:
        settings: the frontend's (the body's size limit).
        gate: the prompt gate, or None (then 501).
        parse: the API's counting parser (400 naming a bad field): the
            prompt's job, and the API's thinking switch (None: not given).
        answer: the API's answer for a count of ``n`` tokens.
    """

    def __init__(self, settings: FrontendSettings, gate: PromptGate | None,
                 parse: Callable[[Any], tuple[GenerationRequest, bool | None]],
                 answer: Callable[[int], dict]) -> None:
        self.settings = settings
        self.gate = gate
        self.parse = parse
        self.answer = answer

    def on_post(self, req, resp) -> None:
        generation, thinking = self.parse(
            read_json_body(req, self.settings.max_body_bytes))
        if self.gate is None:
            raise NotSupported(NO_VOCAB)
        counted = self.gate.check(with_thinking(self.gate, generation, thinking))
        resp.media = self.answer(len(counted.prompt_tokens))
