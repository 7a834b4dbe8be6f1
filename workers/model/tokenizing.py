"""Tokenising a prompt with bounded work, for the frontend's gate and the worker.

llama.cpp's tokeniser first splits the text at every occurrence of a special
token's text (``tokenizer_st_partition``), and it keeps the pieces in a
singly linked list that it walks from the head for every match: the work
grows with the *square* of the number of special-token matches. A 1 MB
prompt of ``<s>`` took 522 s of CPU on the test model; Gemma's vocabulary
makes ``\\n`` and ``\\t`` special, so 40 KB of ``\\n\\t`` took 15 s. Only then
was the prompt refused as too long for the context. Two defences:

1. **Refuse by size, before any tokenising.** Every token covers at most
   ``max_token_bytes`` bytes of the prompt (below), so a prompt of B bytes is
   at least ceil(B / max_token_bytes) tokens; if that alone does not fit the
   context, the prompt is refused at once. The bound never refuses a prompt
   that fits: it only counts bytes that some token must cover.
2. **Tokenise in pieces, and stop early.** The prompt is cut only where
   tokenising the pieces gives exactly the tokens of the whole (see
   ``_safe_cut``), pieces are about ``CHUNK_BYTES`` long, so the quadratic
   term is bounded per piece, and tokenising stops as soon as the tokens so
   far fill the context, or the job is cancelled (checked between pieces).

Why a token covers at most ``max_token_bytes`` bytes: for SentencePiece (SPM)
and byte-level BPE vocabularies, which are the GGUF models this pool serves,
every token llama.cpp emits stands for a piece of the prompt that is at most
as long as the token's own text: normal tokens are the (whitespace-escaped,
so never shorter) text they match, special tokens match their exact text,
byte-fallback tokens (``<0x41>``) cover one byte, and a character with no
token at all falls back to bytes (one UTF-8 character is at most 4 bytes). It
does not hold when llama.cpp may drop input: a vocabulary without byte
fallback (SPM) or without all 256 byte tokens (BPE), WordPiece and Unigram
vocabularies (which drop or collapse whitespace), or special tokens that strip
the whitespace next to them (``lstrip``/``rstrip``: then only non-whitespace
bytes are counted). For those the size check is skipped or weakened, and the
pieces still bound the work.
"""

from __future__ import annotations

from collections.abc import Callable

import llama_cpp

from workers.model import llama_internals

#: Target size of one piece handed to llama.cpp. Within a piece the
#: tokeniser's cost grows with the square of the special-token matches
#: (about 1,000 here: milliseconds); between pieces the cancel flag and the
#: context limit are checked.
CHUNK_BYTES = 2048

#: How far past the target a cut is looked for, and how many candidate cuts
#: are checked in full there, before the piece simply grows by another
#: ``CHUNK_BYTES`` (the search costs pure Python per byte).
CUT_SEARCH_BYTES = 256
CUT_CANDIDATES = 16

#: A UTF-8 character is at most this long (a character with no token of its
#: own becomes byte tokens, each covering one byte).
MAX_CHAR_BYTES = 4

_SPECIAL_ATTRS = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
                  | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                  | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)
# With parse_special off, llama.cpp still splits at user-defined tokens.
_SPECIAL_ATTRS_UNPARSED = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
_STRIP_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP | llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
_WHITESPACE = b" \t\n\v\f\r"  # C's isspace(), which llama.cpp's strip uses


class PromptTooLong(ValueError):
    """The prompt has at least ``at_least`` tokens; the context holds ``n_ctx``."""

    def __init__(self, at_least: int, n_ctx: int, exact: bool) -> None:
        what = "is" if exact else "is at least"
        super().__init__(
            f"the prompt {what} {at_least} tokens; the context holds {n_ctx}")
        self.at_least = at_least
        self.n_ctx = n_ctx
        #: False: tokenising stopped early, ``at_least`` is a lower bound.
        self.exact = exact


class TokenizeCancelled(Exception):
    """The job was cancelled while its prompt was being tokenised."""


def _gpt2_byte_chars() -> list[bytes]:
    """How byte-level BPE writes each of the 256 bytes (GPT-2's table)."""
    printable = (list(range(ord("!"), ord("~") + 1))
                 + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b].encode("utf-8") for b in range(256)]


class SpecialTexts:
    """The special tokens' texts, by length, for finding safe cuts."""

    def __init__(self, texts: list[bytes]) -> None:
        by_length: dict[int, set[bytes]] = {}
        for text in texts:
            if text:
                by_length.setdefault(len(text), set()).add(text)
        self.by_length = by_length
        self.lengths = sorted(by_length)
        self.last_bytes = frozenset(t[-1] for t in texts if t)

    def ending_at(self, data: bytes, p: int) -> list[int]:
        """Lengths of the special texts that end exactly at ``p``."""
        if p == 0 or data[p - 1] not in self.last_bytes:
            return []
        return [n for n in self.lengths
                if n <= p and data[p - n:p] in self.by_length[n]]

    def occurs(self, data: bytes, start: int, n: int) -> bool:
        return 0 <= start and start + n <= len(data) and (
            data[start:start + n] in self.by_length[n])


class BoundedTokenizer:
    """Tokenises for one loaded vocabulary with bounded work (module doc)."""

    def __init__(self, llama: llama_cpp.Llama) -> None:
        self._vocab = llama_internals.vocab_handle(llama)
        vocab = self._vocab
        n_vocab = llama.n_vocab()
        texts = [llama_cpp.llama_vocab_get_text(vocab, t) or b""
                 for t in range(n_vocab)]
        attrs = [llama_cpp.llama_vocab_get_attr(vocab, t) for t in range(n_vocab)]
        self._special = {
            True: SpecialTexts([texts[t] for t in range(n_vocab)
                                if attrs[t] & _SPECIAL_ATTRS]),
            False: SpecialTexts([texts[t] for t in range(n_vocab)
                                 if attrs[t] & _SPECIAL_ATTRS_UNPARSED]),
        }
        #: Tokens that swallow neighbouring whitespace: whitespace is not
        #: counted by the size bound, and the prompt is not cut into pieces
        #: (a cut would change what they swallow).
        self._strips = any(a & _STRIP_ATTRS for a in attrs)
        kind = llama_cpp.llama_vocab_type(vocab)
        known = set(texts)
        if kind == llama_cpp.LLAMA_VOCAB_TYPE_SPM:
            lossless = all(b"<0x%02X>" % b in known for b in range(256))
        elif kind == llama_cpp.LLAMA_VOCAB_TYPE_BPE:
            lossless = all(c in known for c in _gpt2_byte_chars())
        else:  # WordPiece, Unigram, RWKV, ...: whitespace may vanish
            lossless = False
        #: The most prompt bytes one token can cover; None: no sound bound.
        self.max_token_bytes: int | None = (
            max(MAX_CHAR_BYTES, *map(len, texts)) if lossless else None)
        # Pieces must tokenise exactly like the whole: pieces after the first
        # get no BOS, so a vocabulary that also appends EOS (or SEP) is
        # tokenised whole.
        self._can_cut = (kind in (llama_cpp.LLAMA_VOCAB_TYPE_SPM,
                                  llama_cpp.LLAMA_VOCAB_TYPE_BPE)
                         and not self._strips
                         and not llama_cpp.llama_vocab_get_add_eos(vocab))

    # --- the size bound ----------------------------------------------------------

    def min_tokens(self, data: bytes) -> int:
        """A lower bound on the tokens of ``data`` (0 if none is known)."""
        if self.max_token_bytes is None:
            return 0
        counted = len(data)
        if self._strips:
            counted -= sum(data.count(bytes([c])) for c in _WHITESPACE)
        return -(-counted // self.max_token_bytes)

    # --- tokenising --------------------------------------------------------------

    def tokenize(self, data: bytes, *, add_special: bool, parse_special: bool,
                 limit: int, should_stop: Callable[[], bool] | None = None
                 ) -> list[int]:
        """The tokens of ``data``, exactly as ``llama_tokenize`` gives them.

        Raises:
            PromptTooLong: the prompt has ``limit`` tokens or more (known from
                its size, or once the pieces so far reach it).
            TokenizeCancelled: ``should_stop`` said so between pieces.
        """
        at_least = self.min_tokens(data)
        if at_least >= limit:
            raise PromptTooLong(at_least, limit, exact=False)
        tokens: list[int] = []
        start = 0
        while start < len(data):
            if should_stop is not None and should_stop():
                raise TokenizeCancelled()
            end = self._next_cut(data, start, parse_special)
            tokens += self._llama_tokenize(data[start:end], add_special and start == 0,
                                           parse_special)
            start = end
            if len(tokens) >= limit:
                raise PromptTooLong(len(tokens), limit, exact=start == len(data))
        if not data:
            tokens = self._llama_tokenize(b"", add_special, parse_special)
        return tokens

    def _llama_tokenize(self, piece: bytes, add_special: bool,
                        parse_special: bool) -> list[int]:
        # Room for every byte, a BOS and a space prefix: one call, not two.
        room = len(piece) + 8
        while True:
            out = (llama_cpp.llama_token * room)()
            n = llama_cpp.llama_tokenize(self._vocab, piece, len(piece), out, room,
                                         add_special, parse_special)
            if n >= 0:
                return out[:n]
            room = -n

    # --- where a prompt may be cut ---------------------------------------------

    def _next_cut(self, data: bytes, start: int, parse_special: bool) -> int:
        """The end of the piece that starts at ``start``: a safe cut about
        ``CHUNK_BYTES`` further on, or the end of the prompt."""
        if not self._can_cut:
            return len(data)
        special = self._special[parse_special]
        target = start + CHUNK_BYTES
        while target < len(data):
            checked = 0
            for p in range(target, min(target + CUT_SEARCH_BYTES, len(data))):
                for n in special.ending_at(data, p):
                    if _safe_cut(special, data, p, n):
                        return p
                    checked += 1
                if checked >= CUT_CANDIDATES:
                    break
            target += CHUNK_BYTES
        return len(data)


def _safe_cut(special: SpecialTexts, data: bytes, p: int, n: int) -> bool:
    """Whether tokenising ``data[:p]`` and ``data[p:]`` apart gives the
    tokens of the whole, given that a special text of length ``n`` ends at p.

    llama.cpp splits the text at special-token matches, longest tokens first
    (ties in no defined order), each token's matches leftmost-first in what
    is left unsplit; then it tokenises each plain piece on its own, with SPM's
    space prefix at the start and after every special token (so a piece that
    starts after a special token is tokenised as a prompt of its own would
    be). The cut at p is therefore exact if:

    * no special text occurs across p (then every match lies wholly on one
      side, and each side is split exactly as within the whole), and
    * the match ``[p - n, p)`` is taken: no occurrence of a special text at
      least as long overlaps it (a longer one would be taken first, one as
      long might be). Shorter ones come later and cannot take it.

    Then p is a border between a special token and the next piece in the
    whole, as it is at the end of one prompt and the start of the next.
    """
    s = p - n
    for m in special.lengths:
        # Across p: starts before p and ends after it.
        for q in range(max(0, p - m + 1), p):
            if special.occurs(data, q, m):
                return False
        if m < n:
            continue
        # Overlapping [s, p) and ending by p, other than the match itself.
        for q in range(max(0, s - m + 1), p - m + 1):
            if (q != s or m != n) and special.occurs(data, q, m):
                return False
    return True
