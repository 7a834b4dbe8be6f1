"""Reasoning kept apart from the answer: ``<think>…</think>``.

Thinking models write their reasoning between ``<think>`` and ``</think>``,
either after a ``<think>`` the template already put at the end of the prompt
(DeepSeek-R1's distills, Qwen3 with some templates) or opening it
themselves. ``ReasoningSplit`` reads the output, streamed or whole, and
hands out two texts: the reasoning and the answer. It is the one parser for
both: a whole answer is one ``feed`` and a ``finish``, so any split of a
stream gives the same two texts (a property test says so). The reasoning is
stripped of the whitespace around it, and the answer of the whitespace
that follows ``</think>``, as llama.cpp's server does.

Whether a request's output is split (``reasoning_split``):

* ``reasoning_format: "none"``: never, the tags stay in the text;
* ``"deepseek"`` or ``"auto"`` (llama-server's names): always;
* absent: when the model's template reasons (it writes ``<think>``).

Whether the output starts inside the reasoning is read from the prompt's
last tokens, which needs the frontend's vocabulary (``--model``); without it
only a ``<think>`` the model writes itself is found.

``chat_template_kwargs`` (``{"enable_thinking": false}``) is checked here
and rendered by the template (``workers.model.prompting``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from frontend.errors import BadRequest
from frontend.request_fields import RequestFields
from protocol.payloads import GenerationRequest

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: llama-server's ``reasoning_format`` values served here.
FORMATS = ("none", "deepseek", "auto")
#: How many of the prompt's last tokens are read for an open ``<think>``.
_PROMPT_TAIL_TOKENS = 8

_START, _REASONING, _AFTER, _CONTENT = range(4)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Reasoning and answer from output text given piece by piece.

    Args:
        opened: the prompt ended inside ``<think>``: the output starts as
            reasoning.
    """

    def __init__(self, opened: bool = False) -> None:
        self._state = _REASONING if opened else _START
        self._buf = ""
        self._emitted_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that ``text`` completes."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            before = (self._state, self._buf)
            if self._state == _START:
                self._start(final)
            elif self._state == _REASONING:
                reasoning += self._reasoning(final)
            elif self._state == _AFTER:
                stripped = self._buf.lstrip()
                if stripped or final:
                    self._state, self._buf = _CONTENT, stripped
            else:
                content, self._buf = content + self._buf, ""
            if (self._state, self._buf) == before:
                return reasoning, content

    def _start(self, final: bool) -> None:
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._state, self._buf = _REASONING, stripped[len(THINK_OPEN):]
        elif final or (stripped and not THINK_OPEN.startswith(stripped)):
            self._state = _CONTENT

    def _reasoning(self, final: bool) -> str:
        """Reasoning up to ``</think>`` (then the state moves on), holding
        back what may be the start of the tag or trailing whitespace."""
        if not self._emitted_reasoning:
            self._buf = self._buf.lstrip()
        at = self._buf.find(THINK_CLOSE)
        if at >= 0:
            out = self._buf[:at].rstrip()
            self._state, self._buf = _AFTER, self._buf[at + len(THINK_CLOSE):]
        elif final:
            out, self._buf = self._buf.rstrip(), ""
            self._state = _CONTENT
        else:
            safe = self._buf[:len(self._buf) - _partial_suffix(self._buf,
                                                               THINK_CLOSE)]
            out = safe.rstrip()
            self._buf = self._buf[len(out):]
        self._emitted_reasoning = self._emitted_reasoning or bool(out)
        return out


def split_whole(text: str, opened: bool = False) -> tuple[str, str]:
    """``ReasoningSplit`` on a whole answer: (reasoning, answer)."""
    split = ReasoningSplit(opened)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    return reasoning + more_reasoning, content + more_content


def reasoning_format(fields: RequestFields) -> str | None:
    """``reasoning_format``: one of ``FORMATS``, or None (the default)."""
    value = fields.get("reasoning_format")
    if value is not None and value not in FORMATS:
        raise BadRequest(f"'reasoning_format' must be one of {', '.join(FORMATS)}"
                         f"; got {str(value)[:40]!r}", param="reasoning_format")
    return value


def template_kwargs(fields: RequestFields) -> str:
    """``chat_template_kwargs`` as the JSON text the worker's template gets
    ("" for none); the template's own check (that it reads each name)
    happens where the prompt is rendered."""
    value = fields.get("chat_template_kwargs")
    return template_variables(value, "chat_template_kwargs")


def template_variables(value: Any, param: str) -> str:
    if value is None or value == {}:
        return ""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadRequest(f"'{param}' must be an object", param=param)
    return json.dumps(value, ensure_ascii=False)


def template_reasons(template: str) -> bool:
    """Whether a chat template is a reasoning model's: it writes ``<think>``."""
    return THINK_OPEN in template


def reasoning_split(gate, generation: GenerationRequest,
                    requested: str | None = None) -> ReasoningSplit | None:
    """The split for one answer, or None when its text stays whole.

    A grammar (a forced tool call, a JSON schema) makes the whole output
    the answer, so it is not read as starting inside the reasoning even
    when the prompt opened it; a ``<think>`` the grammar lets the model
    write is still split off.

    Args:
        gate: the frontend's prompt gate (None: no vocabulary here).
        generation: the job, its prompt tokens made by the gate (if any).
        requested: the request's ``reasoning_format`` (None: not given).
    """
    if requested == "none":
        return None
    builder = gate.builder() if gate is not None else None
    if requested is None and (builder is None
                              or not template_reasons(builder.template)):
        return None
    tokens = generation.prompt_tokens
    opened = False
    if builder is not None and tokens and not (generation.grammar
                                               or generation.force_call):
        tail = b"".join(builder.pieces(tokens[-_PROMPT_TAIL_TOKENS:]))
        opened = tail.decode("utf-8", "replace").rstrip().endswith(THINK_OPEN)
    return ReasoningSplit(opened)


#: The template variable reasoning templates (Qwen3's, and others after it)
#: read to think or not.
THINKING_SWITCH = "enable_thinking"


def with_thinking(gate, generation: GenerationRequest,
                  thinking: bool | None) -> GenerationRequest:
    """``generation`` with ``enable_thinking`` set for its template, when an
    API's own switch (Anthropic's ``thinking``, the Responses ``reasoning``)
    asked and the template reads it. A template that does not read it
    thinks or not by itself: the switch has nothing to turn. Without the
    vocabulary here the template's default holds (README)."""
    builder = gate.builder() if gate is not None else None
    if thinking is None or builder is None or (
            THINKING_SWITCH not in builder.template):
        return generation
    variables = json.dumps({THINKING_SWITCH: thinking})
    return dataclasses.replace(generation, chat_template_kwargs=variables)
