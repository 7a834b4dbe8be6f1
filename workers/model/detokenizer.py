"""Incremental, UTF-8-safe detokenisation of a token stream."""

from __future__ import annotations

import codecs
import ctypes

import llama_cpp


class IncrementalDetokenizer:
    """Turns tokens into text one at a time without splitting a character.

    A multi-byte character can span several byte-fallback tokens; the
    incremental decoder keeps the incomplete bytes until the rest arrive.
    ``Llama.detokenize`` is not used because its fixed 32-byte buffer asserts
    on longer pieces (Gemma has whitespace and markup tokens that long).
    """

    def __init__(self, vocab: ctypes.c_void_p, special: bool = False,
                 preserved: frozenset[int] = frozenset()) -> None:
        self._vocab = vocab
        self._special = special
        #: Control tokens written as their text even so (a tool format's
        #: markers: ``PromptBuilder.preserved_tokens``).
        self._preserved = preserved
        self._buffer = ctypes.create_string_buffer(256)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, token: int) -> bytes:
        special = self._special or token in self._preserved
        n = llama_cpp.llama_token_to_piece(
            self._vocab, token, self._buffer, len(self._buffer), 0, special
        )
        if n < 0:  # buffer too small: -n is the size needed
            self._buffer = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(
                self._vocab, token, self._buffer, len(self._buffer), 0, special
            )
        return self._buffer.raw[:n]

    def push(self, token: int) -> str:
        """Text completed by this token (may be empty mid-character)."""
        return self._decoder.decode(self.piece(token))

    def flush(self) -> str:
        """Whatever bytes are left, with invalid ones replaced."""
        return self._decoder.decode(b"", final=True)
