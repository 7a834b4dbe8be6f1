"""OpenAI response objects for completions and chat, streamed or whole."""

from __future__ import annotations

import json
import time

from frontend.errors import http_form
from frontend.logprob_format import CompletionLogprobs, chat_logprobs
from protocol import messages
from protocol.payloads import Timings, TokenLogprob, Usage


def _dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ResponseShaper:
    """Builds the JSON a client expects for one request.

    Args:
        kind: ``completion`` or ``chat``.
        request_id: used in the ``id`` field.
        model: model name echoed back.
        include_usage: stream a usage chunk before ``[DONE]``.
        logprobs: choices carry ``logprobs`` (else null).
    """

    def __init__(self, kind: str, request_id: str, model: str,
                 include_usage: bool = False, logprobs: bool = False) -> None:
        self.kind = kind
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs
        self._completion_logprobs = CompletionLogprobs()
        self._sent_role = False

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries)
        return self._completion_logprobs.shape(entries)

    def _chunk(self, choices: list, **extra) -> bytes:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage and "usage" not in obj:
            obj["usage"] = None
        return b"data: " + _dumps(obj).encode() + b"\n\n"

    def _choice(self, text: str, finish_reason: str | None,
                entries: list[TokenLogprob]) -> dict:
        logprobs = self._logprobs(entries)
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta: dict = {}
        if not self._sent_role:
            delta["role"] = "assistant"
            self._sent_role = True
        if text or finish_reason is None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    # --- streaming ---------------------------------------------------------------

    def text_event(self, text: str, entries: list[TokenLogprob] = ()) -> bytes:
        return self._chunk([self._choice(text, None, list(entries))])

    def final_events(self, text: str, finish_reason: str, usage: Usage,
                     timings: Timings, entries: list[TokenLogprob] = ()) -> bytes:
        out = self._chunk([self._choice(text, finish_reason, list(entries))],
                          timings=timings.public())
        if self.include_usage:
            out += self._chunk([], usage=usage.public())
        return out + b"data: [DONE]\n\n"

    def text_frame_event(self, msg: messages.Token) -> bytes:
        """The event for a job's TOKEN frame (``frontend.sse``)."""
        return self.text_event(msg.text, msg.logprobs)

    def final_frame_events(self, msg: messages.Final) -> bytes:
        """The events for a job's FINAL frame (``frontend.sse``)."""
        return self.final_events(msg.text, msg.finish_reason, msg.usage,
                                 msg.timings, msg.logprobs)

    @staticmethod
    def error_event(code: str, message: str) -> bytes:
        """A terminating error: no ``[DONE]`` follows, so clients see a failure.

        Type and status come from the same table as an error answered before
        the headers (``frontend.errors.HTTP_FORMS``), so a stream that fails
        with a client's mistake says so, as its HTTP answer would have.
        """
        form = http_form(code)
        body = {"error": {"message": message, "type": form.type, "code": str(code),
                          "status": form.status}}
        return b"data: " + _dumps(body).encode() + b"\n\n"

    # --- whole response ----------------------------------------------------------

    def whole(self, text: str, finish_reason: str, usage: Usage,
              timings: Timings, entries: list[TokenLogprob] = ()) -> dict:
        logprobs = self._logprobs(list(entries))
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.public(),
            "timings": timings.public(),
        }

