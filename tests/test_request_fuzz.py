"""Request bodies from a fuzzer, through real gunicorn: never a 5xx.

hypothesis builds bodies for both generation endpoints from the fields they
read, filled with any JSON (deep nesting, huge and negative numbers, lone
surrogates, wrong types), and sends them as raw bytes. Every answer must be a
JSON response below 500, within the client timeout (no hang), and after the
run every slot is free again (none taken for good).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pool_factory import pool_fixture

pytestmark = pytest.mark.stack

FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "stop", "stream",
          "stream_options", "seed", "n", "model", "ignore_eos", "repeat_penalty",
          "presence_penalty", "frequency_penalty", "logprobs", "echo", "tools"]

#: Strings a tokenizer or an encoder might choke on.
NASTY_TEXT = st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "<s>" * 50,
                              "<|im_end|>", "\u202e", "é" * 3])
TEXT = st.one_of(st.text(max_size=20), NASTY_TEXT)
NUMBER = st.one_of(st.integers(min_value=-(10**30), max_value=10**30),
                   st.sampled_from([10**400, -(10**400), 2**63, 2**64]),
                   st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.one_of(st.sampled_from(["role", "content", "type",
                                                 "text", "include_usage"]), TEXT),
                      inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), JSON),
     "content": st.one_of(TEXT, JSON)})
#: One or two fields replaced by anything, on top of a valid request, so most
#: examples get past the other fields to the one under attack.
OVERRIDES = st.dictionaries(st.sampled_from(FIELDS),
                            st.one_of(JSON, st.lists(MESSAGE, max_size=3)),
                            max_size=2)


def _encode(body) -> bytes:
    # ensure_ascii writes lone surrogates as \\udXXX escapes, as a hostile
    # client would; allow_nan is off because NaN is not JSON.
    return json.dumps(body, ensure_ascii=True, allow_nan=False).encode()


pool = pool_fixture(workers=1)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(chat=st.booleans(), message=MESSAGE, overrides=OVERRIDES)
def test_no_request_body_gets_a_5xx(pool, chat, message, overrides):
    base = ({"messages": [message]} if chat else {"prompt": message["content"]})
    body = {**base, "max_tokens": 4, **overrides}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(pool.url + path, content=_encode(body), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream"):
        assert "data: [DONE]" in r.text or '"error"' in r.text, r.text
    else:
        r.json()  # every answer is JSON


def test_the_fuzzed_pool_is_whole(pool):
    """Runs after the fuzzer (file order): no slot was kept."""
    pool.assert_whole()
    assert "Traceback" not in pool.frontend.log()
