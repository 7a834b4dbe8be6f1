"""Log-probabilities in OpenAI's two shapes, from the workers' typed entries.

Chat completions list one object per token (``token``, ``logprob``, its UTF-8
``bytes`` and ``top_logprobs``); completions use the legacy parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs`` as maps, ``text_offset``).
A token's text is its bytes decoded with replacement: a token that is only
part of a character shows U+FFFD, and ``bytes`` has the truth.
"""

from __future__ import annotations

from protocol.payloads import TokenCandidate, TokenLogprob


def _text(candidate: TokenCandidate) -> str:
    return candidate.piece.decode("utf-8", errors="replace")


def _chat_candidate(candidate: TokenCandidate) -> dict:
    return {"token": _text(candidate), "logprob": candidate.logprob,
            "bytes": list(candidate.piece)}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """A chat choice's ``logprobs`` object."""
    return {"content": [{**_chat_candidate(e),
                         "top_logprobs": [_chat_candidate(t) for t in e.top]}
                        for e in entries],
            "refusal": None}


class CompletionLogprobs:
    """A completion choice's ``logprobs``; keeps the text offset across the
    chunks of one stream."""

    def __init__(self) -> None:
        self._offset = 0

    def shape(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for entry in entries:
            text = _text(entry)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(t): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }
