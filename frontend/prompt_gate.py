"""Counting prompt tokens at the door, so an over-long prompt never takes a slot.

Only possible when the frontend can read the model file (its vocabulary is
loaded, not its weights); ``llamapool up`` always arranges that. A frontend
without the file passes requests through and the worker refuses an over-long
prompt before generating (HTTP 400 either way).
"""

from __future__ import annotations

import dataclasses
import threading

from frontend import model_code
from frontend.errors import BadRequest
from protocol.errors import ErrorCode
from protocol.payloads import CHAT, GenerationRequest


class PromptGate:
    """Tokenises requests and refuses prompts longer than the context."""

    def __init__(self, model_path: str, chat_format: str | None, n_ctx: int) -> None:
        self.model_path = model_path
        self.chat_format = chat_format
        self.n_ctx = n_ctx
        self._builder = None
        self._lock = threading.Lock()

    def load(self) -> None:
        self._prompts()

    def builder(self):
        """The vocabulary-only ``PromptBuilder`` (the native tokenizer and
        template endpoints use it: ``frontend.native_api``)."""
        return self._prompts()

    def _prompts(self):
        # Loaded on first use, after gunicorn's fork, once per process.
        if self._builder is None:
            with self._lock:
                if self._builder is None:
                    self._builder = model_code.PromptBuilder.vocab_only(
                        self.model_path, self.chat_format
                    )
        return self._builder

    def check(self, generation: GenerationRequest) -> GenerationRequest:
        """The request with ``prompt_tokens`` (and the chat format's stop
        strings) attached; raise 400 if the prompt cannot fit."""
        try:
            # Refused by its size before tokenising, or as soon as the
            # tokens so far fill the context (``workers.model.tokenizing``).
            tokens, stops = self._prompts().tokens(generation, limit=self.n_ctx)
        except model_code.ToolsUnsupported as exc:
            raise BadRequest(str(exc), param="tools",
                             code=str(ErrorCode.TOOLS_UNSUPPORTED)) from None
        except model_code.PromptError as exc:
            raise BadRequest(f"cannot render messages: {exc}",
                             param="messages") from None
        except model_code.PromptTooLong as exc:
            param = "messages" if generation.kind == CHAT else "prompt"
            raise model_code.prompt_too_long(exc, param) from None
        return dataclasses.replace(generation, prompt_tokens=tokens,
                                   extra_stops=stops)
