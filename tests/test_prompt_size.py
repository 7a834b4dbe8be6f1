"""Huge prompts are refused quickly, whoever tokenises them, and free their slot.

llama.cpp's tokeniser is quadratic in the number of special-token matches:
a 1 MB prompt of ``<s>`` took 522 s of CPU (300 KB: 31 s) before the
correct 400, in the frontend's gate or, without ``--model``, in the worker,
whose slot stayed busy all that time even after its client had gone.
``workers.model.tokenizing`` refuses a prompt whose size alone rules it out
and tokenises the rest in pieces; these tests hold it to a deadline that the
old code misses by minutes.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest

from tests.pool import Pool, wait_until
from tests.pool_factory import pool_fixture
from workers.model import tokenizing
from workers.model.prompting import PromptBuilder
from workers.model.tokenizing import BoundedTokenizer, PromptTooLong, TokenizeCancelled

pytestmark = pytest.mark.stack

#: Generous: the fixed code answers in well under a second.
DEADLINE_S = 20.0
#: Just under the default 1 MiB body limit once wrapped in JSON.
MEGABYTE = 1_000_000

ATTACKS = {
    "special tokens": "<s>" * (MEGABYTE // 3),
    "ordinary text": ("Hello world, how are you today? " * (MEGABYTE // 32)),
}


#: The frontend tokenises (``--model``), as ``llamapool up`` runs it.
gated_pool = pool_fixture(workers=1)


#: No ``--model`` for the frontend: the worker tokenises every prompt.
ungated_pool = pool_fixture(workers=1, frontend_tokenizes=False)


def post_in_time(pool: Pool, body: dict) -> httpx.Response:
    started = time.monotonic()
    r = httpx.post(pool.url + "/v1/" + ("chat/completions" if "messages" in body
                                        else "completions"),
                   json=body, timeout=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S
    return r


def assert_context_exceeded(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "exceeds the available context size" in error["message"]


@pytest.mark.parametrize("where", ["frontend", "worker"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_megabyte_prompt_gets_400_quickly(request, where, attack):
    pool = request.getfixturevalue("gated_pool" if where == "frontend"
                                   else "ungated_pool")
    r = post_in_time(pool, {"prompt": ATTACKS[attack], "max_tokens": 1})
    assert_context_exceeded(r)
    if attack == "special tokens":  # the chat path renders, then tokenises
        chat = {"messages": [{"role": "user", "content": ATTACKS[attack]}],
                "max_tokens": 1}
        assert_context_exceeded(post_in_time(pool, chat))
    pool.assert_whole(timeout_s=DEADLINE_S)
    # The pool serves on.
    assert post_in_time(pool, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_prompt_that_fits_still_works(gated_pool, ungated_pool):
    """The size check refuses nothing that fits: 600 special tokens (far more
    bytes than 2048 tokens of one-byte text) go through, in both places."""
    for pool in (gated_pool, ungated_pool):
        r = post_in_time(pool, {"prompt": "<s>" * 600 + "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 600


def test_an_abandoned_huge_prompt_frees_the_worker_slot(ungated_pool):
    """The client sends a megabyte of ``<s>`` and hangs up at once: the slot
    comes back within the deadline (it stayed busy for minutes before)."""
    pool = ungated_pool
    payload = json.dumps({"prompt": ATTACKS["special tokens"], "max_tokens": 5,
                          "stream": True}).encode()
    before = pool.status()["counters"].get("submitted", 0)
    with socket.create_connection(("127.0.0.1", pool.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        wait_until(lambda: pool.status()["counters"].get("submitted", 0) > before,
                   DEADLINE_S, "the job to reach the broker")
    pool.assert_whole(timeout_s=DEADLINE_S)


# --- in process: the bound is sound, the pieces are exact ---------------------------


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return PromptBuilder.vocab_only(str(tiny_model), None)


def test_the_size_bound_never_exceeds_the_true_count(prompts):
    tok = prompts._tokenizer
    assert tok.max_token_bytes == len("<|im_start|>")
    for text in ["<s>" * 50, "Hello world " * 20, "\n\t" * 40, "é日本" * 30,
                 "<|im_start|>" * 40, ""]:
        data = text.encode()
        exact = prompts.llama.tokenize(data, add_bos=False, special=True)
        assert tok.min_tokens(data) <= len(exact)


def test_pieces_tokenise_exactly_like_the_whole(prompts, monkeypatch):
    """With tiny pieces, many cuts: the tokens are still llama.cpp's own."""
    monkeypatch.setattr(tokenizing, "CHUNK_BYTES", 6)
    monkeypatch.setattr(tokenizing, "CUT_SEARCH_BYTES", 6)
    tok: BoundedTokenizer = prompts._tokenizer
    alphabet = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "\n", " ",
                "  ", "a", "hello", "<", ">", "s", "é", "日本", "<s", "/s>"]
    rng = random.Random(5)
    for _ in range(1500):
        data = "".join(rng.choice(alphabet)
                       for _ in range(rng.randint(0, 30))).encode()
        for add_special in (True, False):
            whole = prompts.llama.tokenize(data, add_bos=add_special, special=True)
            assert tok.tokenize(data, add_special=add_special, parse_special=True,
                                limit=10**9) == whole, data


def test_tokenising_stops_at_the_limit_and_on_cancel(prompts, monkeypatch):
    monkeypatch.setattr(tokenizing, "CHUNK_BYTES", 64)
    tok: BoundedTokenizer = prompts._tokenizer
    data = b"<s>" * 300  # passes the size bound for a limit of 100
    with pytest.raises(PromptTooLong, match="at least"):
        tok.tokenize(data, add_special=True, parse_special=True, limit=100)
    asked = []

    def cancel_after_first_piece() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(TokenizeCancelled):
        tok.tokenize(data, add_special=True, parse_special=True, limit=10**9,
                     should_stop=cancel_after_first_piece)
    assert len(asked) == 2
