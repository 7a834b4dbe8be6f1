"""Which chat template a process renders with, from its three settings.

``--chat-format NAME`` (llama-cpp-python's named formats), ``--chat-template
NAME_OR_JINJA`` (llama.cpp's built-in names, or a Jinja template's text, as
llama-server reads the flag) and ``--chat-template-file FILE``: at most one.
Workers and the frontend's prompt gate take the one string this makes, so
they render alike (``workers.model.chat_templates`` reads it).
"""

from __future__ import annotations

from protocol.settings import ConfigError, setting

#: Prefixes of the string: a llama-cpp-python format name holds no colon.
TEMPLATE_FILE, TEMPLATE_FLAG = "file:", "chat-template:"


class ChatChoiceError(ValueError):
    """More than one of the three settings was given."""


def chat_choice(chat_format: str | None, chat_template: str,
                chat_template_file: str) -> str | None:
    """The ``chat_format`` string engines take (None: the GGUF's template)."""
    given = [n for n, v in (("--chat-format", chat_format),
                            ("--chat-template", chat_template),
                            ("--chat-template-file", chat_template_file)) if v]
    if len(given) > 1:
        raise ChatChoiceError(f"give one of {' and '.join(given)}, not both")
    if chat_template_file:
        return TEMPLATE_FILE + chat_template_file
    if chat_template:
        return TEMPLATE_FLAG + chat_template
    return chat_format


def checked_chat_choice(chat_format: str | None, chat_template: str,
                        chat_template_file: str) -> str | None:
    """``chat_choice``, with two settings given a ``ConfigError`` (a
    settings class's ``__post_init__``)."""
    try:
        return chat_choice(chat_format, chat_template, chat_template_file)
    except ChatChoiceError as exc:
        raise ConfigError(f"chat template: {exc}") from None


# The worker and the frontend's prompt gate render alike, so they take the
# two template settings alike: each class declares its fields with these.

def chat_template_setting():
    return setting(
        "", "LLAMAPOOL_CHAT_TEMPLATE", "llama.cpp template name, or Jinja",
        shown="(none)", flag="--chat-template",
        help="llama.cpp's built-in chat template by name (chatml, llama3, "
             "gemma, mistral-v7, ...), or a Jinja template's text, as "
             "llama-server reads it")


def chat_template_file_setting():
    return setting(
        "", "LLAMAPOOL_CHAT_TEMPLATE_FILE", "Jinja chat template file",
        shown="(none)", flag="--chat-template-file",
        help="a Jinja chat template file, instead of the GGUF's")
