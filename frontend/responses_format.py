"""OpenAI Responses answers, whole or streamed.

The answer is a ``response`` object whose ``output`` holds a ``message``
item (``output_text`` content) and, when tools were offered and the model
called them, one ``function_call`` item per call. ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason:
"max_output_tokens"`` when the budget ran out.

A stream is the Responses event sequence, each event with its
``sequence_number``: ``response.created``, ``response.in_progress``; for the
message, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for a call,
``response.output_item.added``, ``response.function_call_arguments.delta``
and ``.done``, ``response.output_item.done``; last ``response.completed``
or ``response.incomplete``. A job that fails mid-stream ends with an
``error`` event and ``response.failed``.

A model's reasoning (``frontend.reasoning``) is a ``reasoning`` item
before the message, its text in ``content`` as ``reasoning_text`` (as vLLM
gives it; ``summary`` is empty, since nothing summarises it), streamed with
``response.reasoning_text.delta`` and ``.done``.

With tools, the text is held until the end, where its calls are found, as
the chat endpoint holds it (``frontend.tool_calls``).
"""

from __future__ import annotations

import json
import time
import uuid

from frontend.errors import http_form
from frontend.reasoning import ReasoningSplit
from frontend.tool_calls import split_calls
from protocol import messages
from protocol.payloads import TokenLogprob, Usage


def usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": []}


def _sse(obj: dict) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


def output_items(text: str, tools: bool, single_call: bool, status: str,
                 tool_format: str = "") -> list[dict]:
    """The answer's items: its message (if it has text, or no calls), then a
    ``function_call`` per call when tools were offered."""
    content, calls = split_calls(text, tool_format) if tools else (text, [])
    if single_call:
        calls = calls[:1]
    items = []
    if content or not calls:
        items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex,
                      "status": status, "role": "assistant",
                      "content": [_part(content or "")]})
    for call in calls:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


class ResponsesShaper:
    """One ``/v1/responses`` answer (a ``frontend.interfaces.Shaper``).

    Args:
        request_id: the response's id is ``resp_<request_id>``.
        model: the model named in the answer.
        echo: the request's settings the response object repeats.
        tools: tools were offered (hold the text, find calls).
        single_call: answer at most one call.
        reasoning: splits the reasoning off into a ``reasoning`` item
            (``frontend.reasoning``); None: the text is whole.
    """

    def __init__(self, request_id: str, model: str, echo: dict, *,
                 tools: bool = False, single_call: bool = False,
                 reasoning: ReasoningSplit | None = None) -> None:
        self.id = "resp_" + request_id
        self.model = model
        self.echo = echo
        self.tools = tools
        self.single_call = single_call
        self.created_at = int(time.time())
        self._reasoning = reasoning
        self._sequence = 0
        self._started = False
        #: Streamed items, done or open, in output order.
        self._items: list[dict] = []
        #: The open item's texts (reasoning or answer) so far.
        self._open_text: list[str] = []
        self._held: list[str] = []

    def response(self, status: str, output: list[dict], use: dict | None,
                 finish_reason: str = "", error: dict | None = None) -> dict:
        incomplete = ({"reason": "max_output_tokens"}
                      if finish_reason == "length" else None)
        return {"id": self.id, "object": "response",
                "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": incomplete, "model": self.model,
                "output": output, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "truncation": "disabled", "usage": use, **self.echo}

    @staticmethod
    def _status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def _split(self, text: str, final: bool = False) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        thought, content = self._reasoning.feed(text)
        if final:
            more_thought, more_content = self._reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    # --- streaming ---------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _sse(obj)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        shown = self.response("in_progress", [], None)
        return (self._event("response.created", response=shown)
                + self._event("response.in_progress", response=shown))

    def _open(self, kind: str) -> bytes:
        """Open a ``reasoning`` or ``message`` item (closing the one before)."""
        out = self._close("completed")
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex,
                    "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex,
                    "status": "in_progress", "role": "assistant", "content": []}
        self._items.append(item)
        index = len(self._items) - 1
        out += self._event("response.output_item.added", output_index=index,
                           item=dict(item))
        if kind == "message":
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=index, content_index=0,
                               part=_part(""))
        return out

    def _delta(self, kind: str, text: str) -> bytes:
        if not text:
            return b""
        open_item = self._items[-1] if self._items else None
        out = b""
        if open_item is None or open_item["type"] != kind or (
                open_item["status"] != "in_progress"):
            out = self._open(kind)
        self._open_text.append(text)
        item = self._items[-1]
        event = ("response.reasoning_text.delta" if kind == "reasoning"
                 else "response.output_text.delta")
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self._event(event, item_id=item["id"],
                                 output_index=len(self._items) - 1,
                                 content_index=0, delta=text, **extra)

    def _close(self, status: str) -> bytes:
        """Finish the open item, if any, with its whole text."""
        item = self._items[-1] if self._items else None
        if item is None or item["status"] != "in_progress":
            return b""
        text, self._open_text = "".join(self._open_text), []
        index = len(self._items) - 1
        fields = {"item_id": item["id"], "output_index": index,
                  "content_index": 0}
        if item["type"] == "reasoning":
            item.update(content=[{"type": "reasoning_text", "text": text}],
                        status="completed")
            out = self._event("response.reasoning_text.done", text=text, **fields)
        else:
            item.update(content=[_part(text)], status=status)
            out = (self._event("response.output_text.done", text=text,
                               logprobs=[], **fields)
                   + self._event("response.content_part.done", part=_part(text),
                                 **fields))
        return out + self._event("response.output_item.done", output_index=index,
                                 item=item)

    def _call_events(self, item: dict) -> bytes:
        self._items.append(item)
        index = len(self._items) - 1
        fields = {"item_id": item["id"], "output_index": index}
        return (self._event("response.output_item.added", output_index=index,
                            item=dict(item, arguments="", status="in_progress"))
                + self._event("response.function_call_arguments.delta",
                              delta=item["arguments"], **fields)
                + self._event("response.function_call_arguments.done",
                              arguments=item["arguments"], name=item["name"],
                              **fields)
                + self._event("response.output_item.done", output_index=index,
                              item=item))

    def text_frame_event(self, msg: messages.Token) -> bytes:
        out = self._start()
        thought, text = self._split(msg.text)
        out += self._delta("reasoning", thought)
        if self.tools:
            self._held.append(text)
            return out
        return out + self._delta("message", text)

    def _held_items(self, text: str, status: str, tool_format: str) -> bytes:
        """With tools: the held answer's message and calls, at the end."""
        out = b""
        for item in output_items(text, True, self.single_call, status,
                                 tool_format):
            if item["type"] == "message":
                out += self._delta("message", item["content"][0]["text"])
                if not self._items or self._items[-1]["type"] != "message":
                    out += self._open("message")  # an empty message
                out += self._close(status)
            else:
                out += self._call_events(item)
        return out

    def final_frame_events(self, msg: messages.Final) -> bytes:
        out = self._start()
        status = self._status(msg.finish_reason)
        thought, text = self._split(msg.text, final=True)
        out += self._delta("reasoning", thought)
        if self.tools:
            out += self._held_items("".join(self._held) + text, status,
                                    msg.tool_format)
        else:
            out += self._delta("message", text)
            if not any(i["type"] == "message" for i in self._items):
                out += self._open("message")
            out += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else (
            "response.completed")
        return out + self._event(kind, response=self.response(
            status, self._items, usage(msg.usage), msg.finish_reason))

    def error_event(self, code: str, message: str) -> bytes:
        """An ``error`` event, then ``response.failed``: the stream's end."""
        out = self._start()
        form = http_form(code)
        out += self._event("error", code=str(code), message=message, param=None)
        return out + self._event("response.failed", response=self.response(
            "failed", [], None, error={"code": form.type, "message": message}))

    # --- whole ---------------------------------------------------------------------

    def whole_answer(self, text: str, final: messages.Final,
                     entries: list[TokenLogprob] = ()) -> dict:
        status = self._status(final.finish_reason)
        thought, text = self._split(text, final=True)
        items = output_items(text, self.tools, self.single_call, status,
                             final.tool_format)
        if thought:
            items.insert(0, {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex,
                             "summary": [], "status": "completed",
                             "content": [{"type": "reasoning_text",
                                          "text": thought}]})
        return self.response(status, items, usage(final.usage),
                             final.finish_reason)
