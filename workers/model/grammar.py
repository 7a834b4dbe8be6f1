"""Constrained output: GBNF grammars and JSON schemas, with llama.cpp's machinery.

The frontend turns ``response_format`` and ``json_schema`` into GBNF with
llama-cpp-python's own converter (``llama_grammar.json_schema_to_gbnf``) and
checks that a grammar compiles with llama.cpp's own parser, both before a
slot is taken. The worker compiles the grammar again against its vocabulary
(never trusting the network) and applies it token by token
(``GrammarConstraint``).

Bounds, because both the converter and the sampler can be made to do
unbounded work:

* The converter spells ``minItems``/``maxItems``, ``minLength``/``maxLength``
  and regex quantifiers out as repeated rules (and recurses once per optional
  item): ``{"maxItems": 10**9}`` would build a string of gigabytes. Every such
  count is limited, and so is their sum, the schema's nesting depth and the
  grammar's size.
* llama.cpp's grammar engine keeps a parse stack per way of reaching the
  next terminal, and walks all of them for every token; nested optional
  rules make 2^depth of them from a few hundred bytes, inside one C call
  that cannot be interrupted. The count is bounded from the rules before
  llama.cpp sees a grammar, and followed token by token in the worker
  (``workers.model.grammar_stacks``).
* The grammar is applied outside llama-cpp-python's sampler chain. In the
  chain, a grammar that admits no token (a logit bias or ``ignore_eos`` that
  bans every token it allows, or a grammar that needs a NUL byte) makes the
  sampler pick a token the grammar rejects, and llama.cpp then throws or
  aborts inside a C call: the worker process dies. Here a dead end is seen
  before sampling, and generation stops instead.
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_grammar

from workers.model.gbnf_parse import GbnfSyntaxError, ParsedGrammar, parse_gbnf
from workers.model.grammar_stacks import (
    MAX_GRAMMAR_STACKS,
    GrammarRefused,
    LiveStacks,
    worst_stacks,
)

#: Largest repetition count (``maxItems``, ``maxLength``, ``{n,m}``) a schema
#: may ask for; llama.cpp's own GBNF parser refuses more than 2000.
MAX_SCHEMA_REPETITION = 256
#: Largest sum of all repetition counts in one schema.
MAX_SCHEMA_REPETITIONS_TOTAL = 2048
#: Deepest nesting of objects and arrays in a schema (the converter recurses).
MAX_SCHEMA_DEPTH = 32
#: Largest grammar accepted, converted from a schema (characters).
MAX_GRAMMAR_CHARS = 256 * 1024
#: Largest grammar a client may give. llama.cpp's parser prints a grammar it
#: refuses, whole, to stderr (``fprintf``, past its log callback), so this
#: also bounds what one bad request adds to a log.
MAX_GIVEN_GRAMMAR_CHARS = 64 * 1024
#: Deepest nesting of parentheses in a grammar. llama.cpp's parser recurses
#: once per level: 100,000 levels overflow the stack and kill the process
#: (SIGSEGV). The converter nests one level per optional repetition, so this
#: stays above ``MAX_SCHEMA_REPETITION``.
MAX_GRAMMAR_NESTING = 512

_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength")
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


class GrammarError(ValueError):
    """The grammar or schema cannot be used; the message says why."""


def _check_schema_bounds(schema: Any) -> None:
    total = 0

    def visit(node: Any, depth: int) -> None:
        nonlocal total
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH}")
        if isinstance(node, list):
            for item in node:
                visit(item, depth + 1)
            return
        if not isinstance(node, dict):
            return
        counts = [node.get(k) for k in _COUNT_KEYS]
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for low, high in _QUANTIFIER.findall(pattern):
                counts += [int(low) if low else 0, int(high) if high else 0]
        for count in counts:
            if count is None:
                continue
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise GrammarError("item and length limits must be integers >= 0")
            if count > MAX_SCHEMA_REPETITION:
                raise GrammarError(
                    f"a repetition of {count} exceeds {MAX_SCHEMA_REPETITION}")
            total += count
        if total > MAX_SCHEMA_REPETITIONS_TOTAL:
            raise GrammarError("the schema's repetitions add up to more than "
                               f"{MAX_SCHEMA_REPETITIONS_TOTAL}")
        for value in node.values():
            visit(value, depth + 1)

    visit(schema, 0)


def schema_to_gbnf(schema: Any) -> str:
    """GBNF for a JSON schema (an object), by llama-cpp-python's converter.

    Raises:
        GrammarError: not an object, beyond the bounds, or not convertible.
    """
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    if not schema:
        schema = {"type": "object"}  # llama.cpp's server does the same
    _check_schema_bounds(schema)
    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise GrammarError("the schema is too deeply nested") from None
    except Exception as exc:  # the converter asserts and raises freely
        raise GrammarError(f"unsupported schema: {str(exc)[:200]}") from None
    _free(_compile(gbnf, None)[0])
    return gbnf


def check_gbnf(gbnf: str, vocab: ctypes.c_void_p | None = None) -> None:
    """Raise ``GrammarError`` unless llama.cpp's parser accepts ``gbnf``, a
    grammar given by a client.

    Without a vocabulary, a token written as text (``<hello>``) does not
    parse (``<[id]>`` does); the worker checks again with its own.
    """
    if len(gbnf) > MAX_GIVEN_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GIVEN_GRAMMAR_CHARS} "
                           "characters")
    _free(_compile(gbnf, vocab)[0])


def grammar_nesting(gbnf: str) -> int:
    """The deepest nesting of parentheses in GBNF, outside literals
    (``"..."``), character classes (``[...]``) and comments."""
    depth = deepest = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in "\"[":
            close = "\"" if c == "\"" else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _bounded(gbnf: str, token_id: Any = None) -> ParsedGrammar:
    """The grammar's rules, once its parse stacks are known to stay within
    ``MAX_GRAMMAR_STACKS``."""
    try:
        parsed = parse_gbnf(gbnf, token_id)
        worst = worst_stacks(parsed)
    except GbnfSyntaxError as exc:
        raise GrammarError(f"the grammar does not parse: {exc}") from None
    except GrammarRefused as exc:
        raise GrammarError(f"unsupported grammar: {exc}") from None
    if worst > MAX_GRAMMAR_STACKS:
        raise GrammarError(
            f"the grammar can keep more than {MAX_GRAMMAR_STACKS} parse stacks "
            "at once (nested optional or repeated rules), and llama.cpp walks "
            "every one for every token; nest fewer optional items")
    return parsed


def _compile(gbnf: str, vocab: ctypes.c_void_p | None,
             token_id: Any = None) -> tuple[ctypes.c_void_p, ParsedGrammar]:
    if not gbnf.strip():
        raise GrammarError("the grammar is empty")
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} "
                           "characters")
    if "\x00" in gbnf:
        raise GrammarError("the grammar contains a NUL character")
    if grammar_nesting(gbnf) > MAX_GRAMMAR_NESTING:
        raise GrammarError("the grammar nests parentheses deeper than "
                           f"{MAX_GRAMMAR_NESTING}")
    parsed = _bounded(gbnf, token_id)  # before llama.cpp builds its stacks
    sampler = llama_cpp.llama_sampler_init_grammar(
        vocab, gbnf.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("the grammar does not parse (GBNF, with a 'root' "
                           "rule, no left recursion, repetitions <= 2000)")
    return sampler, parsed


def _token_id_in(vocab: ctypes.c_void_p):
    """A ``<token>`` written as text, as llama.cpp's parser reads it: the
    one token it tokenizes to (special tokens parsed), else -1."""
    def token_id(text: str) -> int:
        raw = text.encode("utf-8")
        out = (llama_cpp.llama_token * 2)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), out, 2, False, True)
        return out[0] if n == 1 else -1
    return token_id


def _free(sampler: ctypes.c_void_p) -> None:
    llama_cpp.llama_sampler_free(sampler)


class GrammarConstraint:
    """One request's grammar, applied to the raw logits before sampling.

    ``mask`` is a logits processor (it must run after any bias or ban);
    ``accept`` advances the grammar by the token generated. If no token is
    allowed, ``mask`` leaves only end-of-generation ones and sets
    ``dead_end``: the caller stops there. ``accept`` raises
    ``GrammarError`` for a token after which llama.cpp would keep more
    than ``MAX_GRAMMAR_STACKS`` parse stacks, before llama.cpp sees it.
    """

    _sampler = None  # until compiled: close() and __del__ find nothing

    def __init__(self, gbnf: str, vocab: ctypes.c_void_p, n_vocab: int,
                 eog_ids: list[int]) -> None:
        self._sampler, parsed = _compile(gbnf, vocab, _token_id_in(vocab))
        self._live = LiveStacks(parsed)
        self._vocab = vocab
        self._piece = ctypes.create_string_buffer(256)
        self._eog_ids = eog_ids
        self._data = (llama_cpp.llama_token_data * n_vocab)()
        view = np.ctypeslib.as_array(self._data)
        self._ids = view["id"]
        self._logits = view["logit"]
        self._ids[:] = np.arange(n_vocab, dtype=np.int32)
        self._array = llama_cpp.llama_token_data_array(
            data=self._data, size=n_vocab, selected=-1, sorted=False)
        self.dead_end = False

    def mask(self, input_ids: Any, scores: np.ndarray) -> np.ndarray:
        n = len(self._data)
        self._ids[:] = np.arange(n, dtype=np.int32)
        self._logits[:] = scores[:n]
        self._array.size, self._array.selected, self._array.sorted = n, -1, False
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        # The grammar sampler keeps ids in place; only logits change.
        masked = self._logits
        if not np.isfinite(masked).any():
            self.dead_end = True
            masked = np.full(n, -np.inf, dtype=scores.dtype)
            masked[self._eog_ids or [0]] = 0.0
        scores[:n] = masked
        return scores

    def accept(self, token: int) -> None:
        if token not in self._eog_ids:
            try:
                self._live.accept(token, self._piece_of(token))
            except GrammarRefused as exc:
                raise GrammarError(str(exc)) from None
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def _piece_of(self, token: int) -> bytes:
        """The token's bytes as llama.cpp's grammar reads them (special
        tokens spelled out)."""
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece,
                                           len(self._piece), 0, True)
        if n < 0:  # -n: the size it needs
            self._piece = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece,
                                               -n, 0, True)
        return self._piece.raw[:max(n, 0)]

    def close(self) -> None:
        if self._sampler:
            _free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
