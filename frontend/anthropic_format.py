"""Anthropic Messages answers, whole or streamed, and Anthropic's error shape.

A stream is Anthropic's event sequence: ``message_start`` (the message with
no content yet) and a ``ping``, then for each content block a
``content_block_start``, its ``content_block_delta`` events (``text_delta``,
``input_json_delta``) and a ``content_block_stop``, then one
``message_delta`` with the ``stop_reason`` and the usage, and
``message_stop``. Every event is sent as ``event: <type>`` with its JSON.

A model's reasoning (``frontend.reasoning``) is a ``thinking`` block
before the answer's, streamed with ``thinking_delta`` events and an empty
``signature_delta`` (a local model's thinking is not signed).

Text streams as it comes. When tools were offered, the text is held until
the end, where its calls are found (``frontend.tool_calls.split_calls``),
as the chat endpoint holds it: a call's opening marker cannot be told from
text before it is complete. Then the text block and one ``tool_use`` block
per call go out at once; meanwhile a ``ping`` goes out every
``PING_INTERVAL_S`` while tokens arrive and nothing else is sent.

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens
computed for this request, ``cache_read_input_tokens`` those a worker's
cache held, and their sum is what ``count_tokens`` counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from frontend.errors import ApiError, NoSlotAvailable, http_form
from frontend.reasoning import ReasoningSplit
from frontend.tool_calls import loads_shallow, split_calls
from protocol import tool_formats
from protocol import messages
from protocol.payloads import TokenLogprob, Usage

#: Anthropic's error type for each HTTP status it uses.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error",
               504: "timeout_error", 529: "overloaded_error"}
#: Anthropic's status for "cannot serve now": the pool's 503s are that.
OVERLOADED = 529
#: While text is held (tools offered), a ``ping`` at most this often, so
#: a proxy or client watching for a silent connection sees it alive.
PING_INTERVAL_S = 5.0


def error_status_type(status: int) -> tuple[int, str]:
    """Anthropic's status and error type for one of the pool's statuses."""
    if status == 503:
        status = OVERLOADED
    if status in ERROR_TYPES:
        return status, ERROR_TYPES[status]
    return status, "invalid_request_error" if status < 500 else "api_error"


def error_shape(error: ApiError) -> tuple[int, dict]:
    """An ``frontend.errors.ErrorShape``: ``{"type": "error", "error":
    {"type", "message"}}``. A full pool is 529 ``overloaded_error`` with its
    Retry-After (the header comes from the error, as for every family)."""
    status, kind = error_status_type(error.status)
    if isinstance(error, NoSlotAvailable):
        status, kind = OVERLOADED, ERROR_TYPES[OVERLOADED]
    return status, {"type": "error", "error": {"type": kind,
                                               "message": error.message}}


def _event(obj: dict) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


def usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens}


def _tool_use(call: dict) -> dict | None:
    """An OpenAI-shaped call as a ``tool_use`` block (None: its arguments
    are no JSON object, which Anthropic's ``input`` must be)."""
    fn = call["function"]
    try:
        arguments = loads_shallow(fn["arguments"])
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": fn["name"], "input": arguments}


def content_blocks(text: str, tools: bool, single_call: bool,
                   tool_format: str = "") -> list[dict]:
    """The answer's blocks: its text, then its calls when tools were offered.
    A call that cannot be a ``tool_use`` stays text, as the model wrote it."""
    if not tools:
        return [{"type": "text", "text": text}] if text else []
    content, calls = split_calls(text, tool_format)
    if single_call:
        calls = calls[:1]
    blocks, kept = [], [content or ""]
    for call in calls:
        block = _tool_use(call)
        if block is None:
            fn = call["function"]
            kept.append(tool_formats.by_name(tool_format).write(
                fn["name"], fn["arguments"]))
        else:
            blocks.append(block)
    shown = "".join(kept)
    return ([{"type": "text", "text": shown}] if shown else []) + blocks


class MessagesShaper:
    """One ``/v1/messages`` answer (a ``frontend.interfaces.Shaper``).

    Args:
        request_id: the message's id is ``msg_<request_id>``.
        model: the model named in the answer.
        n_prompt: the prompt's tokens if the door counted them (for
            ``message_start``; the final usage is the worker's).
        tools: tools were offered (hold the text, find calls).
        single_call: answer at most one call.
        stop_sequences: the client's, to tell ``stop_sequence`` apart.
        reasoning: splits the reasoning off into a ``thinking`` block
            (``frontend.reasoning``); None: the text is whole.
        clock: monotonic seconds (for the pings while text is held).
    """

    def __init__(self, request_id: str, model: str, *, n_prompt: int = 0,
                 tools: bool = False, single_call: bool = False,
                 stop_sequences: tuple[str, ...] = (),
                 reasoning: ReasoningSplit | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.id = "msg_" + request_id
        self.model = model
        self.n_prompt = n_prompt
        self.tools = tools
        self.single_call = single_call
        self.stop_sequences = stop_sequences
        self._reasoning = reasoning
        self._started = False
        #: The type of the block being streamed ("thinking", "text"), or None.
        self._open: str | None = None
        self._index = 0
        self._held: list[str] = []
        self._clock = clock
        self._last_sent = clock()

    def _message(self, content: list, stop_reason: str | None,
                 stop_sequence: str | None, use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": use}

    def stop(self, final: messages.Final, blocks: list[dict]
             ) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence`` for how the job ended."""
        if final.finish_reason == "length":
            return "max_tokens", None
        if any(b["type"] == "tool_use" for b in blocks):
            return "tool_use", None
        if final.stopping_word and final.stopping_word in self.stop_sequences:
            return "stop_sequence", final.stopping_word
        return "end_turn", None

    def _split(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of the next piece of output."""
        if self._reasoning is None:
            return "", text
        thought, content = self._reasoning.feed(text)
        if final:
            more_thought, more_content = self._reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    # --- streaming ---------------------------------------------------------------

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        start_usage = {"input_tokens": self.n_prompt, "output_tokens": 0,
                       "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}
        return (_event({"type": "message_start", "message": self._message(
                    [], None, None, start_usage)})
                + _event({"type": "ping"}))

    def _delta(self, kind: str, text: str) -> bytes:
        """``text`` for a block of type ``kind`` ("thinking" or "text"),
        opening it (and closing the one before) if need be."""
        if not text:
            return b""
        out = b""
        if self._open != kind:
            out = self._close()
            self._open = kind
            block = ({"type": "thinking", "thinking": "", "signature": ""}
                     if kind == "thinking" else {"type": "text", "text": ""})
            out += _event({"type": "content_block_start", "index": self._index,
                           "content_block": block})
        delta = ({"type": "thinking_delta", "thinking": text}
                 if kind == "thinking" else {"type": "text_delta", "text": text})
        return out + _event({"type": "content_block_delta", "index": self._index,
                             "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            # Anthropic signs its thinking; a local model's is unsigned.
            out = _event({"type": "content_block_delta", "index": self._index,
                          "delta": {"type": "signature_delta", "signature": ""}})
        self._open = None
        self._index += 1
        return out + _event({"type": "content_block_stop",
                             "index": self._index - 1})

    def _tool_use_events(self, block: dict) -> bytes:
        out = self._close()
        index, self._index = self._index, self._index + 1
        start = dict(block, input={})
        return out + (
            _event({"type": "content_block_start", "index": index,
                    "content_block": start})
            + _event({"type": "content_block_delta", "index": index,
                      "delta": {"type": "input_json_delta", "partial_json":
                                json.dumps(block["input"], ensure_ascii=False)}})
            + _event({"type": "content_block_stop", "index": index}))

    def _held_ping(self, out: bytes) -> bytes:
        now = self._clock()
        if not out and now - self._last_sent >= PING_INTERVAL_S:
            out = _event({"type": "ping"})
        if out:
            self._last_sent = now
        return out

    def text_frame_event(self, msg: messages.Token) -> bytes:
        out = self._start()
        thought, text = self._split(msg.text)
        out += self._delta("thinking", thought)
        if self.tools:
            self._held.append(text)
            return self._held_ping(out)
        return out + self._delta("text", text)

    def final_frame_events(self, msg: messages.Final) -> bytes:
        out = self._start()
        thought, text = self._split(msg.text, final=True)
        out += self._delta("thinking", thought)
        blocks = []
        if self.tools:
            blocks = content_blocks("".join(self._held) + text, True,
                                    self.single_call, msg.tool_format)
            for block in blocks:
                out += (self._delta("text", block["text"]) if block["type"] == "text"
                        else self._tool_use_events(block))
        else:
            out += self._delta("text", text)
        out += self._close()
        stop_reason, stop_sequence = self.stop(msg, blocks)
        return (out + _event({"type": "message_delta",
                              "delta": {"stop_reason": stop_reason,
                                        "stop_sequence": stop_sequence},
                              "usage": usage(msg.usage)})
                + _event({"type": "message_stop"}))

    def error_event(self, code: str, message: str) -> bytes:
        """Anthropic's ``error`` event; no ``message_stop`` follows."""
        _, kind = error_status_type(http_form(code).status)
        return _event({"type": "error", "error": {"type": kind,
                                                  "message": message}})

    # --- whole ---------------------------------------------------------------------

    def whole_answer(self, text: str, final: messages.Final,
                     entries: list[TokenLogprob] = ()) -> dict:
        thought, text = self._split(text, final=True)
        blocks = content_blocks(text, self.tools, self.single_call,
                                final.tool_format)
        if thought:
            blocks.insert(0, {"type": "thinking", "thinking": thought,
                              "signature": ""})
        stop_reason, stop_sequence = self.stop(final, blocks)
        return self._message(blocks, stop_reason, stop_sequence,
                             usage(final.usage))
