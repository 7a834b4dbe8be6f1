"""OpenAI response objects for completions and chat, streamed or whole."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import time

from frontend.errors import http_form
from frontend.logprob_format import CompletionLogprobs, chat_logprobs
from frontend.reasoning import ReasoningSplit
from frontend.tool_calls import split_calls
from protocol import messages
from protocol.payloads import Timings, TokenLogprob, Usage


def _dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def fingerprint(model: str) -> str:
    """``system_fingerprint``: what produced the answer, stable while that
    does not change. llama.cpp sends its build (``b<number>-<commit>``); a
    pool's build is llamapool's version and llama-cpp-python's (which pins
    llama.cpp), and the model served is part of what decides the output, so
    a short hash of its name ends it:
    ``llamapool-0.1.0-llama-cpp-python-0.3.36-<8 hex>``."""
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return (f"llamapool-{_version('llamapool')}-llama-cpp-python-"
            f"{_version('llama_cpp_python')}-{digest}")


def _tool_finish(finish_reason: str) -> str:
    """An answer that ends in calls finishes with ``tool_calls``, as OpenAI
    and llama.cpp say it (unless it was cut short)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ResponseShaper:
    """Builds the JSON a client expects for one request (a ``Shaper``,
    ``frontend.interfaces``).

    Args:
        kind: ``completion`` or ``chat``.
        request_id: used in the ``id`` field.
        model: model name echoed back.
        include_usage: stream a usage chunk before ``[DONE]``.
        logprobs: choices carry ``logprobs`` (else null).
        reasoning: splits the reasoning off the answer (``frontend.reasoning``),
            shown under both names clients read, ``reasoning_content``
            (llama.cpp's) and ``reasoning`` (vLLM's); None: the text is whole.
    """

    def __init__(self, kind: str, request_id: str, model: str,
                 include_usage: bool = False, logprobs: bool = False,
                 system_fingerprint: str | None = None,
                 tools: bool = False,
                 reasoning: ReasoningSplit | None = None) -> None:
        self.kind = kind
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.system_fingerprint = (system_fingerprint if system_fingerprint
                                   is not None else fingerprint(model))
        self._completion_logprobs = CompletionLogprobs()
        self._sent_role = False
        #: Tools offered: the text is held until the end, where its calls are
        #: found (``frontend.tool_calls``); then it goes out at once.
        self.tools = tools and self.chat
        #: The call format the FINAL frame names (``protocol.tool_formats``).
        self._tool_format = ""
        self._held_text: list[str] = []
        self._held_entries: list[TokenLogprob] = []
        self._reasoning = reasoning if self.chat else None

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
            "system_fingerprint": self.system_fingerprint,
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
        if text or finish_reason is None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _role_chunk(self) -> bytes:
        """A chat stream's first chunk names the role and nothing else, as
        OpenAI and llama.cpp send it (``{"role": "assistant", "content":
        null}``); clients that build the message from deltas expect it."""
        if not self.chat or self._sent_role:
            return b""
        self._sent_role = True
        return self._chunk([{"index": 0,
                             "delta": {"role": "assistant", "content": None},
                             "logprobs": None, "finish_reason": None}])

    def _thought_chunk(self, thought: str, entries: list[TokenLogprob]) -> bytes:
        if not thought:
            return b""
        delta = {"reasoning_content": thought, "reasoning": thought}
        return self._role_chunk() + self._chunk([{
            "index": 0, "delta": delta, "logprobs": self._logprobs(entries),
            "finish_reason": None}])

    # --- streaming ---------------------------------------------------------------

    def text_event(self, text: str, entries: list[TokenLogprob] = (),
                   timings: Timings | None = None) -> bytes:
        """One chunk of output; ``timings`` so far when the request asked for
        them on every token (llama.cpp's ``timings_per_token``)."""
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text)
            if not text:  # all reasoning (or held): the tokens go with it
                return self._thought_chunk(thought, list(entries))
            return self._thought_chunk(thought, []) + self._content_event(
                text, entries, timings)
        return self._content_event(text, entries, timings)

    def _content_event(self, text: str, entries: list[TokenLogprob],
                       timings: Timings | None) -> bytes:
        extra = {} if timings is None else {"timings": timings.public()}
        if self.tools:
            self._held_text.append(text)
            self._held_entries += entries
            return self._role_chunk()
        return self._role_chunk() + self._chunk(
            [self._choice(text, None, list(entries))], **extra)

    def _released_calls(self, text: str, entries: list[TokenLogprob],
                        finish_reason: str) -> tuple[bytes, str, str]:
        """With tools: the held answer as one content or tool-calls chunk;
        returns it, the finishing chunk's text and finish reason."""
        whole = "".join(self._held_text) + text
        content, calls = split_calls(whole, self._tool_format)
        if not calls:
            return b"", whole, finish_reason
        delta: dict = {"tool_calls": [{"index": i, **call}
                                      for i, call in enumerate(calls)]}
        if content:
            delta = {"content": content, **delta}
        chunk = self._chunk([{"index": 0, "delta": delta,
                              "logprobs": self._logprobs(entries),
                              "finish_reason": None}])
        return chunk, "", _tool_finish(finish_reason)

    def final_events(self, text: str, finish_reason: str, usage: Usage,
                     timings: Timings, entries: list[TokenLogprob] = ()) -> bytes:
        """The finishing chunk, the usage chunk (if asked) and ``[DONE]``.

        Both carry ``timings``: the finishing chunk as before, and the usage
        chunk because llama.cpp puts them on the stream's last chunk."""
        public = timings.public()
        entries = list(entries)
        out = self._role_chunk()
        if self._reasoning is not None:
            thought, text = self._whole_split(text)
            out += self._thought_chunk(thought, [])
        if self.tools:
            entries = self._held_entries + entries
            calls, text, finish_reason = self._released_calls(
                text, entries, finish_reason)
            if calls:
                out, entries = out + calls, []
        out += self._chunk([self._choice(text, finish_reason, entries)],
                           timings=public)
        if self.include_usage:
            out += self._chunk([], usage=usage.public(), timings=public)
        return out + b"data: [DONE]\n\n"

    def _whole_split(self, text: str) -> tuple[str, str]:
        """The rest of the output (all of it, for a whole answer) split."""
        if self._reasoning is None:
            return "", text
        thought, content = self._reasoning.feed(text)
        more_thought, more_content = self._reasoning.finish()
        return thought + more_thought, content + more_content

    def text_frame_event(self, msg: messages.Token) -> bytes:
        """The event for a job's TOKEN frame (``frontend.sse``)."""
        return self.text_event(msg.text, msg.logprobs, msg.timings)

    def final_frame_events(self, msg: messages.Final) -> bytes:
        """The events for a job's FINAL frame (``frontend.sse``)."""
        self._tool_format = msg.tool_format
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

    def whole_answer(self, text: str, final: messages.Final,
                     entries: list[TokenLogprob] = ()) -> dict:
        """The whole answer: ``text`` is all the job's output, ``final`` its
        FINAL frame, ``entries`` every token's log-probabilities."""
        finish_reason = final.finish_reason
        logprobs = self._logprobs(list(entries))
        if self.chat:
            thought, text = self._whole_split(text)
            message: dict = {"role": "assistant", "content": text}
            if self.tools:
                content, calls = split_calls(text, final.tool_format)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": calls}
                    finish_reason = _tool_finish(finish_reason)
            if thought:
                message.update(reasoning_content=thought, reasoning=thought)
            choice = {"index": 0, "message": message,
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": [choice],
            "usage": final.usage.public(),
            "timings": final.timings.public(),
        }
