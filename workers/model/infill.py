"""Fill-in-the-middle prompts, laid out as llama.cpp's server lays them out.

``format_prompt_infill`` in llama.cpp's ``server-common.cpp`` uses the
repo-level pattern::

    [FIM_REP]myproject\\n[FIM_SEP]file0\\nextra 0 ... [FIM_SEP]filename\\n
    [BOS][FIM_PRE]prefix prompt[FIM_SUF]suffix[FIM_MID]

The same order is built here. Two differences, both on purpose: nothing is
cut to fit a batch (llama.cpp keeps at most 3/4 of ``n_batch`` of prefix);
the whole prompt must fit the context, or the request gets a 400 like any
over-long prompt. And there is no ``--spm-infill`` order.
"""

from __future__ import annotations

import dataclasses

from workers.model.prompting import PromptBuilder

#: llama.cpp's separator between extra chunks when the model has no FIM_SEP.
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


class NoFimTokens(ValueError):
    """The model lacks a fill-in-the-middle token infill needs."""


def fim_problem(builder: PromptBuilder) -> str | None:
    """Why the model cannot do infill, in llama.cpp's words; None if it can."""
    pre, suf, mid, _, _ = builder.fim_tokens()
    missing = "".join(f"{name} token is missing. " for name, token in (
        ("prefix", pre), ("suffix", suf), ("middle", mid)) if token < 0)
    return f"Infill is not supported by this model: {missing}" if missing else None


@dataclasses.dataclass(frozen=True)
class ExtraChunk:
    """One ``input_extra`` entry: context from another file."""

    text: str
    filename: str = "tmp"


def infill_tokens(builder: PromptBuilder, prefix: str, suffix: str, prompt: str,
                  extra: list[ExtraChunk], limit: int) -> list[int]:
    """The prompt tokens of one infill request.

    Raises:
        NoFimTokens: the model cannot do infill.
        PromptTooLong: a piece alone reaches ``limit`` tokens (the caller
            checks the total).
    """
    problem = fim_problem(builder)
    if problem is not None:
        raise NoFimTokens(problem)
    pre, suf, mid, rep, sep = builder.fim_tokens()

    def text(t: str) -> list[int]:
        return builder.tokenize_text(t, add_special=False, parse_special=False,
                                     limit=limit)

    tokens: list[int] = []
    if rep >= 0:
        tokens += [rep, *text("myproject\n")]
    for chunk in extra:
        if sep >= 0:
            tokens += [sep, *text(chunk.filename + "\n")]
        else:
            tokens += text(CHUNK_SEPARATOR)
        tokens += text(chunk.text)
    if sep >= 0:
        tokens += [sep, *text("filename\n")]
    if builder.adds_bos():
        tokens.append(builder.llama.token_bos())
    # The prompt is read as a prompt (special tokens parsed), as llama.cpp.
    prompt_tokens = builder.tokenize_text(prompt, add_special=False,
                                          parse_special=True, limit=limit)
    tokens += [pre, *text(prefix), *prompt_tokens, suf, *text(suffix), mid]
    return tokens
