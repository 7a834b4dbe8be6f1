"""Stop strings and incremental detokenisation, at the unit level."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.llama_internals import EngineLlama
from workers.model.stop_strings import StopStringFilter


def run_filter(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    f = StopStringFilter(stops)
    out = "".join(f.push(p) for p in pieces)
    return out + f.flush(), f.stopped


def test_stop_split_across_pieces_never_leaks():
    out, stopped = run_filter(["Hel", "lo <", "|e", "nd|", "> more"], ["<|end|>"])
    assert (out, stopped) == ("Hello ", True)


def test_partial_match_that_fails_is_released():
    out, stopped = run_filter(["a <", "|x", " b"], ["<|end|>"])
    assert (out, stopped) == ("a <|x b", False)


def test_earliest_of_several_stops_wins():
    out, _ = run_filter(["one two three"], ["three", "two"])
    assert out == "one "


def test_overlapping_stops_stop_at_the_first_completed():
    """Generation ends as soon as any stop string is complete: "<" completes
    before "><<" could, so the text stops there (hypothesis found this)."""
    out, stopped = run_filter([">", "<", "<"], ["<", "><<"])
    assert (out, stopped) == (">", True)


def expected_output(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The reference: after each piece, look for stop strings in all the text so
    far; at the first piece where any occurs, cut at the earliest occurrence
    (llama.cpp's server rule). Nothing after that piece is ever generated."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], True
    return text, False


@given(st.text(alphabet="ab<|>", max_size=40), st.lists(st.integers(1, 5), max_size=20),
       st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), min_size=1,
                max_size=3))
def test_filter_matches_the_reference_for_any_split(text, cuts, stops):
    """Whatever the token boundaries, no stop string leaks and no text that
    precedes the stop is held back."""
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    assert run_filter(pieces, stops) == expected_output(pieces, stops)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    # EngineLlama: llama_cpp.Llama with this CPU's --repack auto (on AMX,
    # llama.cpp's repacked Q4 kernel crashes).
    return EngineLlama(str(tiny_model), n_ctx=256, verbose=False)


def test_multibyte_characters_split_over_byte_tokens(tiny_llama):
    text = "héllo 世界 🦙"
    tokens = tiny_llama.tokenize(text.encode(), add_bos=False)
    # The tiny vocabulary has no pieces for these: they are byte tokens, so a
    # character spans several tokens.
    assert len(tokens) > len(text)
    detok = IncrementalDetokenizer(tiny_llama._model.vocab)
    pieces = [detok.push(t) for t in tokens]
    assert "\ufffd" not in "".join(pieces)
    assert ("".join(pieces) + detok.flush()).strip() == text
