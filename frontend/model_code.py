"""The frontend's one door to the workers' model code (``workers.model``).

The frontend counts prompt tokens with the workers' own prompt builder, lays
out infill prompts beside it, and converts and checks grammars and JSON
schemas with the workers' own grammar code, so the two sides never differ.
Those modules load llama-cpp-python, so they are imported on first use
(after gunicorn's fork, and never by a frontend that has no model file and
no grammar to check): ``model_code.PromptTooLong`` and the like resolve
here, through ``__getattr__``.

It also gives "the prompt does not fit" its one shape for every endpoint,
llama.cpp's (``context_exceeded``).
"""

from __future__ import annotations

from frontend.errors import ContextSizeExceeded
from protocol.errors import context_exceeded_message

#: What this module hands out, once loaded.
_EXPORTS = ("PromptBuilder", "PromptError", "PromptTooLong", "ToolsUnsupported",
            "GrammarError", "check_gbnf", "schema_to_gbnf",
            "ExtraChunk", "NoFimTokens", "fim_problem", "infill_tokens")


def _load() -> None:
    from workers.model.grammar import GrammarError, check_gbnf, schema_to_gbnf
    from workers.model.infill import (
        ExtraChunk,
        NoFimTokens,
        fim_problem,
        infill_tokens,
    )
    from workers.model.prompting import (
        PromptBuilder,
        PromptError,
        PromptTooLong,
        ToolsUnsupported,
    )

    globals().update(
        PromptBuilder=PromptBuilder, PromptError=PromptError,
        PromptTooLong=PromptTooLong, ToolsUnsupported=ToolsUnsupported,
        GrammarError=GrammarError, check_gbnf=check_gbnf,
        schema_to_gbnf=schema_to_gbnf, ExtraChunk=ExtraChunk,
        NoFimTokens=NoFimTokens, fim_problem=fim_problem,
        infill_tokens=infill_tokens)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load()
    return globals()[name]


def context_exceeded(n_prompt_tokens: int, n_ctx: int, param: str,
                     exact: bool = True) -> ContextSizeExceeded:
    """A prompt that does not fit the context, as every endpoint answers it:
    llama.cpp's ``exceed_context_size_error`` with both sizes."""
    return ContextSizeExceeded(
        context_exceeded_message(n_prompt_tokens, n_ctx, exact),
        n_prompt_tokens, n_ctx, param=param)


def prompt_too_long(exc, param: str) -> ContextSizeExceeded:
    """``context_exceeded`` for a ``PromptTooLong`` the tokenizer raised."""
    return context_exceeded(exc.at_least, exc.n_ctx, param, exc.exact)
