"""The grammar's parse stacks, bounded (issue 29, item 1): counted from the
rules before llama.cpp sees them, and followed token by token.

The counts are checked against llama.cpp's own engine where it can be
asked: the parser accepts exactly what llama.cpp's parser accepts, and the
followed stacks allow the end of generation exactly when llama.cpp's mask
does, on the tiny model's real vocabulary.
"""

from __future__ import annotations

import ctypes
import json

import llama_cpp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.model.gbnf_parse import GbnfSyntaxError, parse_gbnf
from workers.model.grammar import (
    GrammarConstraint,
    GrammarError,
    check_gbnf,
    schema_to_gbnf,
)
from workers.model.grammar_stacks import (
    MAX_GRAMMAR_STACKS,
    GrammarRefused,
    LiveStacks,
    worst_stacks,
)
from workers.model.llama_internals import EngineLlama


def nested_optionals(depth: int, lead: str = "") -> str:
    """Issue 29's grammar: 2^depth ways to the first terminal, 18 bytes a
    level."""
    lines = [f'root ::= {lead} r0' if lead else "root ::= r0"]
    lines += [f"r{i} ::= r{i + 1}? r{i + 1}?" for i in range(depth)]
    return "\n".join(lines + [f'r{depth} ::= "a"'])


#: Stacks multiply with the text: both alternatives take "a", and each
#: leaves its own continuation under it; every stack allows only "a", so a
#: model that may not end must write a's.
AMBIGUOUS = 'root ::= r\nr ::= "a" r "a" | "a" r "a" "a" | ""'

JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''


@pytest.mark.parametrize("depth", [1, 2, 5, 8, 9])
def test_the_count_from_the_rules_is_llama_cpps_count(depth):
    grammar = parse_gbnf(nested_optionals(depth))
    assert worst_stacks(grammar, 10**6) == 2**depth + 1
    assert len(LiveStacks(grammar, 10**6)) == 2**depth + 1
    # Behind a literal, the stacks come when it is accepted.
    led = parse_gbnf(nested_optionals(depth, '"a"'))
    live = LiveStacks(led, 10**6)
    assert len(live) == 1
    live.accept(0, b"a")
    assert len(live) == worst_stacks(led, 10**6) == 2**depth + 1


@pytest.mark.parametrize("gbnf", [
    nested_optionals(20, '"a"'),   # issue 29: a worker pinned for minutes
    nested_optionals(17),          # ... and 26 s in the frontend's check
    nested_optionals(7) + "\n" + "x ::= r0 r0",
])
def test_a_grammar_over_the_budget_is_refused_before_llama_cpp_compiles_it(gbnf):
    if "x ::=" in gbnf:
        gbnf = gbnf.replace("root ::= r0", "root ::= x")
    with pytest.raises(GrammarError, match=f"more than {MAX_GRAMMAR_STACKS} parse"):
        check_gbnf(gbnf)


def test_a_schema_pattern_over_the_budget_is_refused():
    with pytest.raises(GrammarError, match="parse stacks"):
        schema_to_gbnf({"type": "string", "pattern": "^((((a?){8}){8}){8}){8}$"})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                      for i in range(100)}},
    {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "object"}]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 200},
    {"type": "string", "format": "date-time"},
    {"type": "string", "maxLength": 256},
])
def test_everyday_schemas_stay_far_inside_the_budget(schema):
    gbnf = schema_to_gbnf(schema)
    assert worst_stacks(parse_gbnf(gbnf)) <= 110


def test_everyday_grammars_stay_inside_it():
    assert worst_stacks(parse_gbnf(JSON_GBNF)) == 12
    check_gbnf(JSON_GBNF)


def test_stacks_that_multiply_with_the_text_are_stopped_as_they_pass_it():
    grammar = parse_gbnf(AMBIGUOUS)
    assert worst_stacks(grammar) == 3  # the rules alone cannot see it
    live = LiveStacks(grammar, 128)
    counts = []
    with pytest.raises(GrammarRefused, match="more than 128"):
        for _ in range(20):
            live.accept(0, b"a")
            counts.append(len(live))
    assert counts == [6, 14, 29, 60, 122]  # the 6th "a" would make 246


def test_a_repetition_whose_maximum_is_below_its_minimum_is_refused():
    # llama.cpp reads {3,1} as 2^64 - 2 optional rules and allocates until
    # the kernel kills the process (the frontend's, at its check).
    with pytest.raises(GrammarError, match="below its minimum"):
        check_gbnf('root ::= "a"{3,1}')


def test_left_recursion_is_refused_as_llama_cpp_refuses_it():
    with pytest.raises(GrammarError, match="left recursion"):
        check_gbnf('root ::= x "a"\nx ::= root | "b"')


# --- the parser against llama.cpp's ------------------------------------------------

_PIECES = st.sampled_from([
    "root", " ::= ", "a", "b-1", " ", "\n", "|", "(", ")", "*", "+", "?",
    "{2}", "{1,3}", "{,2}", "{0,}", '"x"', '"\\n"', '"\\q"', '"\\x4"', "[a-z]",
    "[^\\]]", "[]", ".", "<[5]>", "!<[7]>", "# c\n", "::=", '"', "[", "\t",
    " a ::= ", "\nb-1 ::= ", "\r\n", "{3,1}", "{2001}",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, min_size=1, max_size=14))
def test_the_parser_accepts_what_llama_cpp_accepts(pieces):
    text = "".join(pieces)
    try:
        grammar = parse_gbnf(text)
        worst_stacks(grammar, 10**6)
        ours = True
    except (GbnfSyntaxError, GrammarRefused) as exc:
        if "below its minimum" in str(exc):
            return  # refused here; llama.cpp would eat all memory
        ours = False
    sampler = llama_cpp.llama_sampler_init_grammar(None, text.encode(), b"root")
    theirs = bool(sampler)
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
    assert ours == theirs, text


# --- the followed stacks against llama.cpp's mask -----------------------------------


@pytest.fixture(scope="module")
def tiny_vocab(tiny_model):
    llama = EngineLlama(model_path=str(tiny_model), n_ctx=64, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    eog = [t for t in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    yield vocab, llama.n_vocab(), eog
    llama.close()


@pytest.mark.parametrize("gbnf", [JSON_GBNF, nested_optionals(4, '"a"'),
                                  'root ::= ("ab" | "a" [b-d]+ | "é")+ "."'])
def test_followed_stacks_allow_the_end_exactly_when_llama_cpp_does(tiny_vocab, gbnf):
    vocab, n_vocab, eog = tiny_vocab
    rng = np.random.default_rng(7)
    constraint = GrammarConstraint(gbnf, vocab, n_vocab, eog)
    try:
        for _ in range(40):
            scores = constraint.mask(None, np.zeros(n_vocab, dtype=np.float32))
            allowed = np.flatnonzero(np.isfinite(scores))
            end_allowed = any(not s for s in constraint._live.stacks)
            assert end_allowed == bool(set(allowed) & set(eog)), gbnf
            choices = [t for t in allowed if t not in eog]
            if not choices:
                break
            constraint.accept(int(rng.choice(choices)))
            assert len(constraint._live) >= 1
    finally:
        constraint.close()


def _token_of(vocab, n_vocab: int, piece: str) -> int:
    """The token whose piece is exactly ``piece`` (the tokenizer would add a
    word-start marker)."""
    buf = ctypes.create_string_buffer(64)
    for token in range(n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, 64, 0, True)
        if buf.raw[:n] == piece.encode():
            return token
    raise AssertionError(f"no token for {piece!r}")


def test_the_worker_refuses_the_token_that_passes_the_budget(tiny_vocab):
    vocab, n_vocab, eog = tiny_vocab
    constraint = GrammarConstraint(AMBIGUOUS, vocab, n_vocab, eog)
    a = _token_of(vocab, n_vocab, "a")
    accepted = 0
    try:
        with pytest.raises(GrammarError, match="parse stacks"):
            for _ in range(MAX_GRAMMAR_STACKS):
                constraint.accept(a)
                accepted += 1
    finally:
        constraint.close()
    assert accepted == 5  # 122 stacks; the next "a" would make 246


def test_a_token_the_grammar_does_not_allow_is_refused_not_aborted(tiny_vocab):
    # llama.cpp throws from inside the C call when a token empties its
    # stacks, and the exception ends the process (SIGABRT).
    vocab, n_vocab, eog = tiny_vocab
    constraint = GrammarConstraint('root ::= "a"+', vocab, n_vocab, eog)
    try:
        with pytest.raises(GrammarError, match="does not allow"):
            constraint.accept(_token_of(vocab, n_vocab, "x"))
    finally:
        constraint.close()


def test_a_converted_schema_is_followed_without_refusal(tiny_vocab):
    vocab, n_vocab, eog = tiny_vocab
    gbnf = schema_to_gbnf({"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}})
    constraint = GrammarConstraint(gbnf, vocab, n_vocab, eog)
    try:
        for char in json.dumps({"name": "x", "tags": ["a", "b"]}):
            constraint.accept(_token_of(vocab, n_vocab, char))
        assert any(not s for s in constraint._live.stacks)
    finally:
        constraint.close()
