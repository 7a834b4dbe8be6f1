"""The chat template a pool renders with, chosen as llama-server users choose it.

* the GGUF's own Jinja template (``tokenizer.chat_template``), the default;
* ``--chat-template NAME``: one of llama.cpp's built-in templates (the
  names ``llama_chat_builtin_templates`` lists, from ``src/llama-chat.cpp``:
  chatml, llama3, gemma, mistral-v7, deepseek3, command-r, phi4, ...),
  rendered by llama.cpp's own ``llama_chat_apply_template``; any other
  text is a Jinja template itself, as llama-server reads the flag;
* ``--chat-template-file FILE``: a Jinja template from a file;
* ``--chat-format NAME``: one of llama-cpp-python's named formats (as
  before).

Built-in names are rendered by llama.cpp's C function, not by Jinja copies
of them: the C code is what llama-server runs for a name (``--no-jinja``,
and with ``--jinja`` a name other than chatml is no Jinja at all), it knows
all 54 names of this llama.cpp, and a transcription could drift from it.
Like llama-server's legacy path it renders roles and text only, so tools
are refused there (llama-server: "tools param requires --jinja flag").

Jinja templates render as llama-server's do: the same globals
(``raise_exception``, ``strftime_now``, ``bos_token``, ``eos_token``,
``add_generation_prompt``, ``tools``, ``date_string``, ``datetime``),
``tojson`` without HTML escaping, a message's ``tool_calls`` with their
arguments as objects. A template that fails, or raises, is the request's
400 naming the template (``PromptError``), never a 500.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import os

import llama_cpp
from llama_cpp import llama_chat_format

from protocol.chat_choice import TEMPLATE_FILE, TEMPLATE_FLAG

#: Bigger template files are refused (a template is a few KB; Jinja's
#: compiler should not be handed a large file by mistake).
MAX_TEMPLATE_FILE_BYTES = 1 << 20


class ChatTemplateError(ValueError):
    """A chat template setting that cannot be used (the process's start)."""


def builtin_names() -> list[str]:
    """llama.cpp's built-in template names (``llama_chat_builtin_templates``)."""
    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return [names[i].decode() for i in range(count)]


def is_template_spec(chat_format: str | None) -> bool:
    """Whether a ``protocol.chat_choice`` string names a template (not a
    llama-cpp-python format)."""
    return bool(chat_format) and chat_format.startswith((TEMPLATE_FILE,
                                                         TEMPLATE_FLAG))


def read_template_file(path: str) -> str:
    try:
        if os.path.getsize(path) > MAX_TEMPLATE_FILE_BYTES:
            raise ChatTemplateError(f"--chat-template-file {path}: larger than "
                                    f"{MAX_TEMPLATE_FILE_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template-file {path}: {exc}") from None


class JinjaChat:
    """A Jinja chat template, rendered by llama-cpp-python's Jinja formatter
    (the sandbox, ``raise_exception``, ``strftime_now``, ``tojson``)."""

    def __init__(self, source: str, label: str, *, bos: str, eos: str) -> None:
        self.source = source
        self.label = label
        try:
            # One formatter per value of add_generation_prompt: it is the
            # formatter's attribute, and the frontend's threads share it.
            self._formatters = {flag: llama_chat_format.Jinja2ChatFormatter(
                template=source, eos_token=eos, bos_token=bos,
                add_generation_prompt=flag) for flag in (True, False)}
        except Exception as exc:  # a syntax error, at start: the operator's
            raise ChatTemplateError(f"{label} does not parse: {exc}") from None

    def render(self, turns: list[dict], extra: dict, add_generation_prompt: bool):
        now = _dt.datetime.now()
        context = {"date_string": now.strftime("%d %b %Y"),
                   "datetime": now.strftime("%b %d %Y"), **extra}
        return self._formatters[add_generation_prompt](messages=turns, **context)


class BuiltinChat:
    """One of llama.cpp's built-in templates, by name."""

    source = ""

    def __init__(self, name: str) -> None:
        self.name = name
        self.label = f"llama.cpp's built-in template {name!r}"

    def render(self, turns: list[dict], extra: dict, add_generation_prompt: bool):
        if extra:
            raise ValueError(f"{self.label} takes no template variables "
                             f"({', '.join(sorted(extra))[:80]})")
        chat = (llama_cpp.llama_chat_message * len(turns))()
        kept = []  # the bytes must outlive the call
        for i, turn in enumerate(turns):
            role, content = turn["role"].encode(), str(turn["content"]).encode()
            kept += [role, content]
            chat[i].role, chat[i].content = role, content
        size = sum(len(b) for b in kept) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(
                self.name.encode(), chat, len(turns), add_generation_prompt,
                buf, size)
            if n < 0:
                raise ValueError(f"{self.label} cannot render these messages")
            if n <= size:
                text = buf.raw[:n].decode("utf-8", "replace")
                # Special tokens in the text are parsed when it is tokenised;
                # the tokenizer adds BOS as the model asks (llama-server's
                # legacy path does the same).
                return llama_chat_format.ChatFormatterResponse(
                    prompt=text, stop=None, added_special=False)
            size = n + 1
        raise ValueError(f"{self.label}: the prompt kept growing")  # pragma: no cover


def template_of(spec: str, *, bos: str, eos: str) -> JinjaChat | BuiltinChat:
    """The renderer for a ``protocol.chat_choice`` string that names a
    template: a built-in name, a file, or a template's own text.

    Raises:
        ChatTemplateError: the file cannot be read, or the template parsed.
    """
    if spec.startswith(TEMPLATE_FILE):
        path = spec.removeprefix(TEMPLATE_FILE)
        return JinjaChat(read_template_file(path), f"the chat template file {path}",
                         bos=bos, eos=eos)
    value = spec.removeprefix(TEMPLATE_FLAG)
    if value in builtin_names():
        return BuiltinChat(value)
    return JinjaChat(value, "the --chat-template template", bos=bos, eos=eos)
