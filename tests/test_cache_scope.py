"""The cache tenant, in process (issue 29, item 2): how the frontend makes
it, the fingerprints in its scope, and the worker's check before any reuse.
The same claims through real processes: ``tests/test_cache_scope_pool.py``.
"""

from __future__ import annotations

import falcon.testing
import numpy as np
import pytest

from frontend import native_schema, openai_schema
from frontend.cache_scope import KEY, POOL, TENANT_HEX_CHARS, CacheScope
from frontend.endpoint import JobEndpoint, Submission
from frontend.errors import BadRequest
from frontend.request_fields import MAX_CACHE_SALT_CHARS
from frontend.settings import ConfigError, FrontendSettings
from llamapool.cli import build_parser
from llamapool.supervisor import UP_FRONTEND_FLAGS
from protocol import messages
from protocol.payloads import GenerationRequest, Sampling
from protocol.prefix import BLOCK_TOKENS, prefix_blocks, shared_blocks
from protocol.settings import as_argv, given_flags
from tests.null_sink import NullSink
from workers.model.llama_engine import LlamaEngine
from workers.model.prompt_cache import PromptStateCache

KEYS = ("sk-alpha-0001", "sk-bravo-0002")

# --- the tenant id ------------------------------------------------------------------


def test_each_key_is_its_own_tenant_and_no_key_is_on_the_wire():
    scope = CacheScope(KEY, KEYS)
    a, b = scope.tenant(KEYS[0]), scope.tenant(KEYS[1])
    assert a != b
    for tenant in (a, b):
        assert len(tenant) == TENANT_HEX_CHARS and int(tenant, 16) >= 0
        assert all(k not in tenant and k[-4:] not in tenant for k in KEYS)
    # Every frontend with the same keys (in any order) makes the same ids.
    assert CacheScope(KEY, KEYS[::-1]).tenant(KEYS[0]) == a
    # Keyed by the key set: another pool's frontend makes other ids.
    assert CacheScope(KEY, (*KEYS, "sk-charlie")).tenant(KEYS[0]) != a


def test_a_salt_narrows_either_scope():
    per_key, pool = CacheScope(KEY, KEYS), CacheScope(POOL, KEYS)
    assert pool.tenant(KEYS[0]) == pool.tenant(KEYS[1]) == ""
    assert pool.tenant(KEYS[0], "s") == pool.tenant(KEYS[1], "s") != ""
    assert pool.tenant(KEYS[0], "s") != pool.tenant(KEYS[0], "t")
    assert per_key.tenant(KEYS[0], "s") != per_key.tenant(KEYS[1], "s")
    assert per_key.tenant(KEYS[0], "s") != per_key.tenant(KEYS[0])


@pytest.mark.parametrize("keys", [(), ("only-key",)])
def test_with_no_key_or_one_key_scoping_changes_nothing(keys):
    scope = CacheScope(KEY, keys)
    assert not scope.per_key
    assert scope.tenant(keys[0] if keys else None) == ""
    assert scope.tenant(None, "s") == CacheScope(POOL, keys).tenant(None, "s")


def test_the_endpoint_replaces_the_salt_with_the_tenant():
    class Endpoint(JobEndpoint):
        parse = admit = respond = None

    settings = FrontendSettings(broker_endpoint="ipc:///tmp/x", api_keys=KEYS)
    endpoint = Endpoint(None, settings)
    for header in ("Authorization", "X-Api-Key"):
        value = f"Bearer {KEYS[1]}" if header == "Authorization" else KEYS[1]
        req = falcon.testing.create_req(headers={header: value})
        salted = Submission(None, GenerationRequest("chat", cache_tenant="pepper"))
        scoped = endpoint.scoped(req, salted).generation.cache_tenant
        assert scoped == CacheScope(KEY, KEYS).tenant(KEYS[1], "pepper")
        assert "pepper" not in scoped


# --- the request field --------------------------------------------------------------


PARSERS = {
    "completions": lambda extra: openai_schema.parse_completion(
        {"prompt": "hi", **extra}).generation,
    "chat": lambda extra: openai_schema.parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], **extra}).generation,
    "native": lambda extra: native_schema.parse_completion(
        {"prompt": "hi", **extra}).generation,
}


@pytest.mark.parametrize("endpoint", PARSERS)
def test_cache_salt_is_read_by_every_generation_parser(endpoint):
    parse = PARSERS[endpoint]
    assert parse({}).cache_tenant == ""
    assert parse({"cache_salt": None}).cache_tenant == ""
    assert parse({"cache_salt": "x" * MAX_CACHE_SALT_CHARS}).cache_tenant == (
        "x" * MAX_CACHE_SALT_CHARS)
    for bad in ("", 7, ["a"], {"a": 1}, True, "x" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(BadRequest) as err:
            parse({"cache_salt": bad})
        assert err.value.param == "cache_salt"


def test_the_field_travels_and_has_its_cap():
    request = GenerationRequest("chat", cache_tenant="t" * TENANT_HEX_CHARS)
    submit = messages.Submit("j", request, [1, 2], -1)
    assert messages.decode(submit.to_wire()).request == request
    body = GenerationRequest("chat", cache_tenant="t" * 129).to_body()
    with pytest.raises(messages.MalformedMessage):
        GenerationRequest.from_body(body, "request")


# --- the setting --------------------------------------------------------------------


def test_cache_scope_setting_and_up_forwards_it():
    base = {"LLAMAPOOL_BROKER": "ipc:///tmp/x"}
    assert FrontendSettings.from_env(base).cache_scope == KEY
    assert FrontendSettings.from_env(
        {**base, "LLAMAPOOL_CACHE_SCOPE": "pool"}).cache_scope == POOL
    with pytest.raises(ConfigError, match="LLAMAPOOL_CACHE_SCOPE"):
        FrontendSettings.from_env({**base, "LLAMAPOOL_CACHE_SCOPE": "tenant"})
    # What ``up`` hands its frontend (``supervisor.run_up``).
    args = build_parser().parse_args(["up", "--cache-scope", "pool"])
    argv = as_argv(FrontendSettings,
                   given_flags(args, FrontendSettings, UP_FRONTEND_FLAGS))
    assert argv[argv.index("--cache-scope") + 1] == "pool"
    args = build_parser().parse_args(["up"])
    assert "--cache-scope" not in as_argv(
        FrontendSettings, given_flags(args, FrontendSettings, UP_FRONTEND_FLAGS))


# --- fingerprints -------------------------------------------------------------------


def test_fingerprints_are_in_the_tenants_scope():
    tokens = list(range(4 * BLOCK_TOKENS))
    shared, a, b = (prefix_blocks(tokens, t) for t in ("", "a" * 32, "b" * 32))
    assert len(shared) == len(a) == len(b) == 4
    assert shared_blocks(a, b) == shared_blocks(shared, a) == 0
    assert prefix_blocks(tokens, "a" * 32) == a
    # The shared scope is what it was before tenants (a CRC from 0).
    assert shared == prefix_blocks(tokens)


# --- the worker's check -------------------------------------------------------------


def test_saved_states_serve_only_their_tenant():
    cache = PromptStateCache(1 << 20, "m")
    tokens = np.arange(3 * BLOCK_TOKENS, dtype=np.intc)
    assert cache.put(tokens, b"state-of-b", tenant="b")
    assert cache.longest_prefix(tokens, "a") == (None, 0)
    assert cache.longest_prefix(tokens)[0] is None
    assert cache.longest_prefix(tokens, "b")[1] == len(tokens)
    assert not cache.holds(tokens, "a") and cache.holds(tokens, "b")
    # A's longer state supersedes none of B's.
    assert cache.put(np.arange(4 * BLOCK_TOKENS, dtype=np.intc), b"a", tenant="a")
    assert len(cache) == 2
    # The report says each in its tenant's scope.
    assert sorted(map(tuple, cache.reported_blocks())) == sorted(
        [tuple(prefix_blocks(list(range(4 * BLOCK_TOKENS)), "a")),
         tuple(prefix_blocks(tokens.tolist(), "b"))])


PROMPT = "the cat sat on the mat " * 15


def _run(engine: LlamaEngine, prompt: str, tenant: str):
    request = GenerationRequest(kind="completion", prompt=prompt, max_tokens=8,
                                sampling=Sampling(temperature=0.0, ignore_eos=True),
                                cache_tenant=tenant)
    return engine.run(request, NullSink())


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LlamaEngine(str(tiny_model), n_ctx=1024, n_threads=1, cache_ram_mib=16)


def test_another_tenants_live_sequence_is_cleared_not_extended(engine):
    cold = _run(engine, PROMPT + " one", "b")
    # Its live sequence holds B's prompt: A's identical one reuses none of it.
    guessed = _run(engine, PROMPT + " one", "a")
    assert guessed.cached_tokens == 0
    assert guessed.tail_text == cold.tail_text  # and computes the same
    assert engine.reuse.live_tenant == "a"
    # B's was saved as B's before it was cleared, and B gets it back.
    assert _run(engine, PROMPT + " two", "b").cached_tokens > 100
    # A's was saved as A's in turn: each tenant keeps its own.
    assert _run(engine, PROMPT + " three", "a").cached_tokens > 100
    # A third tenant finds nothing, live or saved, of either.
    assert _run(engine, PROMPT + " four", "c").cached_tokens == 0
    report = engine.prompt_cache_report()[0]
    assert report[0] == prefix_blocks(
        engine.llama.input_ids[:engine.reuse.live_length()].tolist(), "c")
