"""Turning a generation request into prompt tokens: chat rendering + tokenising.

Used by the model worker, and by the frontend when it is given the model file
(a vocab-only load, about 0.5 s and 60 MB for Gemma): then the frontend counts
tokens itself, so a prompt longer than the context is refused at the door,
before it takes a slot, and the worker skips the work.

Tokenising goes through ``workers.model.tokenizing``: a prompt whose size
alone rules it out is refused before any tokenising, and the rest is
tokenised in pieces that stop at the context limit or at a cancel.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import llama_cpp
from llama_cpp import llama_chat_format

from protocol import tool_formats
from protocol.payloads import CHAT, ChatMessage, GenerationRequest
from workers.model import chat_templates, llama_internals
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.grammar import GrammarError
from workers.model.tokenizing import BoundedTokenizer, PromptTooLong, TokenizeCancelled
from workers.model.tool_grammar import call_grammar

# The tokenising errors are raised through ``PromptBuilder.tokens``; callers
# (the frontend's gate too) import them from here.
__all__ = ["PromptBuilder", "PromptError", "PromptTooLong", "TokenizeCancelled",
           "ToolsUnsupported", "TEMPLATE_CHAT_FORMAT"]

#: Name of the chat format that means "the Jinja template in the GGUF".
TEMPLATE_CHAT_FORMAT = "template"

#: The variables llama-cpp-python's Jinja formatter sets itself: a
#: ``chat_template_kwargs`` entry may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "tool_choice", "functions", "function_call",
    "bos_token", "eos_token", "add_generation_prompt", "raise_exception",
    "strftime_now"})

#: Where a reasoning template's generation prompt opens the reasoning; a
#: continued message's reasoning is written after it and closed, as
#: llama.cpp's continuation does (``common/chat-auto-parser-generator.cpp``).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class PromptError(ValueError):
    """The request's messages cannot be rendered."""


class ToolsUnsupported(PromptError):
    """The request offers ``tools``, and the chat format would not render
    them: it is a named format, or a template that never mentions ``tools``
    (``frontend.tool_calls`` says why that is the test)."""


class PromptBuilder:
    """Renders chat messages and tokenises prompts for one model."""

    def __init__(self, llama: llama_cpp.Llama, chat_format: str | None) -> None:
        self.llama = llama
        #: Whether ``tools`` reach the prompt (see ``ToolsUnsupported``).
        self.renders_tools = False
        #: The Jinja template's text, "" with a named chat format or a
        #: built-in template (which take no template variables).
        self.template = ""
        #: The call format the template teaches (``protocol.tool_formats``);
        #: None: it teaches none this pool can read.
        self.tool_format: tool_formats.ToolFormat | None = None
        self._preserved: frozenset[int] | None = None
        #: What a failed rendering names (``PromptError``).
        self.template_label = f"the chat format {chat_format!r}"
        self._template = None
        self._format_chat = self._chat_formatter(chat_format)
        #: llama-cpp-python's "gemma" format drops system messages (it only
        #: logs so, at debug level): they are folded into the first user
        #: turn instead, as Gemma's own chat template does.
        self._fold_system = chat_format == "gemma"
        self._tokenizer = BoundedTokenizer(llama)

    @classmethod
    def vocab_only(cls, model_path: str, chat_format: str | None) -> PromptBuilder:
        """Load just the tokenizer (no weights) for the frontend."""
        llama = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
        return cls(llama, chat_format)

    def _special_texts(self) -> tuple[str, str]:
        model = llama_internals.model_wrapper(self.llama)
        eos, bos = model.token_eos(), model.token_bos()
        return (model.token_get_text(bos) if bos != -1 else "",
                model.token_get_text(eos) if eos != -1 else "")

    def _use_template(self, template) -> None:
        self._template = template
        self.template = template.source
        self.template_label = template.label
        self.tool_format = tool_formats.detect(template.source)
        self.renders_tools = self.tool_format is not None
        self._preserved: frozenset[int] | None = None

    def preserved_tokens(self) -> frozenset[int]:
        """The tool format's markers that are single tokens of this
        vocabulary (``ToolFormat.markers``), to be written as text in an
        answer to a request with tools."""
        if self._preserved is None:
            ids = set()
            for marker in (self.tool_format.markers if self.tool_format else ()):
                tokens = self.llama.tokenize(marker.encode(), add_bos=False,
                                             special=True)
                if len(tokens) == 1:
                    ids.add(tokens[0])
            self._preserved = frozenset(ids)
        return self._preserved

    def _chat_formatter(self, chat_format: str | None):
        """Pick the chat renderer: the GGUF template, a template chosen by
        name or file (``workers.model.chat_templates``), or a named format."""
        if chat_templates.is_template_spec(chat_format):
            bos, eos = self._special_texts()
            self._use_template(chat_templates.template_of(chat_format, bos=bos,
                                                          eos=eos))
            return None
        if chat_format in (None, TEMPLATE_CHAT_FORMAT):
            template = self.llama.metadata.get("tokenizer.chat_template")
            if template:
                bos, eos = self._special_texts()
                self._use_template(chat_templates.JinjaChat(
                    template, "the model's chat template", bos=bos, eos=eos))
                return None
            if chat_format == TEMPLATE_CHAT_FORMAT:
                raise ValueError("the model has no chat template")
            chat_format = "llama-2"  # llama-cpp-python's own fallback
            self.template_label = "the chat format 'llama-2'"
        for name in (chat_format.replace("-", "_"), chat_format.replace("-", "")):
            formatter = getattr(llama_chat_format, "format_" + name, None)
            if formatter is not None:
                return formatter
        raise ValueError(f"unknown chat format {chat_format!r}")

    def render_chat(self, messages: list[ChatMessage], tools: str = "",
                    template_kwargs: str = "", *, add_generation_prompt: bool = True,
                    continue_final: bool = False):
        """The chat prompt for ``messages`` (and ``tools``, OpenAI's list as
        JSON text, "" for none), as the chat endpoint renders it
        (llama-cpp-python's ``ChatFormatterResponse``: ``prompt``, ``stop``,
        ``added_special``). ``/apply-template`` shows this same text.

        ``continue_final``: the last message (the assistant's) is left open,
        as llama.cpp continues it: the messages before it with the
        generation prompt, then its text (``add_generation_prompt`` must be
        false then; the frontend checks).

        Raises:
            ToolsUnsupported: tools given, but the template does not render them.
            PromptError: the messages cannot be rendered.
        """
        extra = {}
        if tools:
            if not self.renders_tools:
                raise ToolsUnsupported(self._no_tools_reason())
            try:
                extra["tools"] = json.loads(tools)
            except ValueError:  # the frontend sends JSON; a peer might not
                raise PromptError("'tools' is not JSON") from None
        extra.update(self._template_variables(template_kwargs))
        turns = self._turns(messages)
        last = turns.pop() if continue_final and turns else None
        if last is not None and last["role"] != "assistant":
            raise PromptError("continue_final_message: the last message is "
                              "not the assistant's")
        rendered = self._render(turns, extra, add_generation_prompt or bool(last))
        if last is not None:
            rendered.prompt = continued(rendered.prompt, last)
        return rendered

    def _no_tools_reason(self) -> str:
        if self.template and "tools" in self.template:
            return ("this model's chat template teaches a tool-call format "
                    "llamapool cannot read (it knows "
                    f"{', '.join(tool_formats.FORMATS)}); use tool_choice "
                    "'none' or a model whose template uses one of them")
        return ("this model's chat template does not support tools "
                "(it never mentions 'tools'); use tool_choice 'none' "
                "or a model whose template renders them")

    def _turns(self, messages: list[ChatMessage]) -> list[dict]:
        """The messages as templates read them. A template that does not
        render ``tool_calls`` itself gets earlier calls written into the
        turn's text, in the call format it teaches (Hermes' if none)."""
        turns = [m.as_dict() for m in messages]
        if self._fold_system:
            turns = fold_system_messages(turns)
        if "tool_calls" in self.template:
            return turns
        writer = self.tool_format or tool_formats.HERMES
        for turn in turns:
            calls = turn.pop("tool_calls", None)
            if calls:
                turn["content"] += "".join(writer.write(c["name"], json.dumps(
                    c["arguments"], ensure_ascii=False)) for c in calls)
        return turns

    def _render(self, turns: list[dict], extra: dict, add_generation_prompt: bool):
        try:
            if self._template is not None:
                return self._template.render(turns, extra, add_generation_prompt)
            if not add_generation_prompt:
                raise PromptError(f"add_generation_prompt false needs a Jinja "
                                  f"or built-in chat template; this pool uses "
                                  f"{self.template_label}")
            return self._format_chat(messages=turns, **extra)
        except PromptError:
            raise
        except Exception as exc:  # a template error is about the input
            raise PromptError(f"{self.template_label} failed to render: "
                              f"{str(exc)[:300]}") from None

    def call_grammar(self, request: GenerationRequest) -> str:
        """The grammar of the call ``request.force_call`` asks for, in this
        model's call format (``workers.model.tool_grammar``).

        Raises:
            ToolsUnsupported: the template teaches no known format.
            PromptError: the tools or the forced name are not usable.
            GrammarError: a schema the converter cannot take.
        """
        if self.tool_format is None:
            raise ToolsUnsupported(self._no_tools_reason())
        try:
            return call_grammar(self.tool_format, request.tools, request.force_call)
        except GrammarError:
            raise
        except (ValueError, AttributeError) as exc:
            raise PromptError(f"'tools': {exc}") from None

    def _template_variables(self, template_kwargs: str) -> dict:
        """``chat_template_kwargs`` (a JSON object as text) for the template.
        A variable the template never names would change nothing, and a
        named chat format takes none: both are refused, not ignored."""
        if not template_kwargs:
            return {}
        try:
            variables = json.loads(template_kwargs)
        except ValueError:  # the frontend sends JSON; a peer might not
            raise PromptError("'chat_template_kwargs' is not JSON") from None
        if not isinstance(variables, dict):
            raise PromptError("'chat_template_kwargs' must be an object")
        if not self.template:
            raise PromptError("'chat_template_kwargs' needs the model's own "
                              "chat template; this pool uses a named chat format")
        unread = next((k for k in variables if k in RESERVED_TEMPLATE_NAMES
                       or k not in self.template), None)
        if unread is not None:
            raise PromptError(f"'chat_template_kwargs': the chat template does "
                              f"not read {unread[:64]!r}")
        return variables

    def tokenize_text(self, text: str, *, limit: int, add_special: bool = True,
                      parse_special: bool = True,
                      should_stop: Callable[[], bool] | None = None) -> list[int]:
        """The tokens of ``text`` as ``llama_tokenize`` gives them, bounded.
        The defaults read a text as a whole input: BOS added, special tokens
        parsed (how llama.cpp's server reads an embedding input); the native
        ``/tokenize`` and ``/infill`` choose.

        Raises:
            PromptTooLong: ``limit`` tokens or more.
            TokenizeCancelled: ``should_stop`` said so between pieces.
        """
        return self._tokenizer.tokenize(text.encode("utf-8"), add_special=add_special,
                                        parse_special=parse_special, limit=limit,
                                        should_stop=should_stop)

    def pieces(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes, special tokens as their text (llama.cpp's
        ``common_token_to_piece``); a piece may be part of a UTF-8 character.
        Valid ids only (``valid_token``)."""
        # One buffer per call: the frontend's threads share this builder.
        detokenizer = IncrementalDetokenizer(
            llama_internals.vocab_handle(self.llama), special=True)
        return [detokenizer.piece(t) for t in tokens]

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.llama.n_vocab()

    def special_text(self, token: int) -> str:
        """The text of a special token such as BOS ("" if the model has none)."""
        return "" if token < 0 else self.pieces([token])[0].decode("utf-8",
                                                                    "replace")

    def fim_tokens(self) -> tuple[int, int, int, int, int]:
        """The model's fill-in-the-middle tokens: prefix, suffix, middle,
        repo and file separator (-1 for each the model lacks)."""
        vocab = llama_internals.vocab_handle(self.llama)
        return (llama_cpp.llama_vocab_fim_pre(vocab),
                llama_cpp.llama_vocab_fim_suf(vocab),
                llama_cpp.llama_vocab_fim_mid(vocab),
                llama_cpp.llama_vocab_fim_rep(vocab),
                llama_cpp.llama_vocab_fim_sep(vocab))

    def adds_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(
            llama_internals.vocab_handle(self.llama)))

    def tokenize_piece(self, text: str, limit: int) -> list[int]:
        """The tokens of a piece of text on its own: no BOS, special tokens
        not parsed (how llama.cpp's server reads a ``logit_bias`` text key).

        Raises:
            PromptTooLong: ``limit`` tokens or more.
        """
        return self._tokenizer.tokenize(text.encode("utf-8"), add_special=False,
                                        parse_special=False, limit=limit)


    def tokens(self, request: GenerationRequest, limit: int,
               should_stop: Callable[[], bool] | None = None,
               ) -> tuple[list[int], list[str]]:
        """Prompt tokens and the chat format's own stop strings.

        Raises:
            PromptError: the messages cannot be rendered.
            PromptTooLong: the prompt has ``limit`` tokens or more.
            TokenizeCancelled: ``should_stop`` turned true on the way.
        """
        if request.kind == CHAT:
            rendered = self.render_chat(
                request.messages, request.tools, request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final=request.continue_final)
            stops = rendered.stop or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            tokens = self._tokenizer.tokenize(
                rendered.prompt.encode("utf-8"),
                add_special=not rendered.added_special, parse_special=True,
                limit=limit, should_stop=should_stop,
            )
            return tokens, stops
        prompt = request.prompt
        if prompt == "":
            return [self.llama.token_bos()], []
        tokens = self._tokenizer.tokenize(
            prompt.encode("utf-8"), add_special=True, parse_special=True,
            limit=limit, should_stop=should_stop)
        return tokens, []


def continued(prompt: str, last: dict) -> str:
    """The prompt with the last (assistant) message appended, open. A
    generation prompt that opens the reasoning gets the message's reasoning
    (closed) and then its text; otherwise its text only."""
    content = str(last.get("content") or "")
    reasoning = str(last.get("reasoning_content") or "")
    head, opens, _ = prompt.rpartition(THINK_OPEN)
    if opens and not prompt[len(head):].strip(THINK_OPEN + "\n "):
        return f"{head}{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"
    return prompt + content


def fold_system_messages(turns: list[dict]) -> list[dict]:
    """System messages joined at the head of the first user turn, as Gemma's
    template does (``first_user_prefix``); a conversation with no user turn
    gets one holding just them. Other turns keep their order."""
    system = [t["content"] for t in turns if t["role"] == "system"]
    rest = [dict(t) for t in turns if t["role"] != "system"]
    if not system:
        return rest
    prefix = "\n\n".join(system)
    for turn in rest:
        if turn["role"] == "user":
            turn["content"] = f"{prefix}\n\n{turn['content']}"
            return rest
    return [{"role": "user", "content": prefix}, *rest]
