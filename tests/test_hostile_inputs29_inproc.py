"""Issue 29, items 3, 4 and 6, in process: the checks' rules, the settings,
what ``up`` forwards, and the app's answers under Falcon's ``TestClient``
(``tests/inproc_pool.py``). The same claims through real processes:
``tests/test_hostile_web.py`` and ``tests/test_hostile_inputs29.py``.
"""

from __future__ import annotations

import json

import pytest

from frontend.cors import HostCheckMiddleware, bind_name, same_origin, split_host
from frontend.errors import BadRequest
from frontend.settings import ConfigError, FrontendSettings
from frontend.tool_calls import (
    MAX_JSON_DEPTH,
    TooDeep,
    history_calls,
    json_depth,
    loads_shallow,
    split_calls,
)
from llamapool.cli import build_parser
from llamapool.supervisor import UP_FRONTEND_FLAGS
from protocol.settings import as_argv, given_flags
from protocol.tool_formats import HERMES

BASE = {"LLAMAPOOL_BROKER": "ipc:///tmp/x"}

# --- Host -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, name, port", [
    ("Example.COM.", "example.com", None),
    ("example.com:8080", "example.com", 8080),
    ("[::1]:80", "::1", 80),
    ("[::1]", "::1", None),
    ("::1", "::1", None),
    ("10.0.0.1:x", "10.0.0.1", None),
])
def test_split_host(value, name, port):
    assert split_host(value) == (name, port)


@pytest.mark.parametrize("host", [
    "localhost", "localhost:8080", "app.localhost", "127.0.0.1:1", "10.2.3.4",
    "[::1]:8080", "[fe80::1]", "pool.example", "POOL.example.:443", "a.lan.example",
    "lan.example", ""])
def test_served_hosts(host):
    check = HostCheckMiddleware(("pool.example", ".lan.example"))
    assert check.serves(host)


@pytest.mark.parametrize("host", [
    "rebind.example", "pool.example.attacker.net", "localhost.attacker.example",
    "127.0.0.1.nip.io", "xlan.example", "evil-lan.example"])
def test_refused_hosts(host):
    check = HostCheckMiddleware(("pool.example", ".lan.example"))
    assert not check.serves(host)


def test_this_machines_name_is_served():
    import socket

    assert HostCheckMiddleware(()).serves(socket.gethostname())


@pytest.mark.parametrize("bind, name", [
    ("127.0.0.1:8080", None), ("0.0.0.0:8080", None), ("[::]:80", None),
    ("unix:/run/pool.sock", None), ("gpu-box:8080", "gpu-box")])
def test_the_bind_name(bind, name):
    assert bind_name(bind) == name


# --- Origin ---------------------------------------------------------------------------


@pytest.mark.parametrize("origin, host, same", [
    ("http://127.0.0.1:8080", "127.0.0.1:8080", True),
    ("https://pool.example", "pool.example", True),
    ("https://pool.example", "pool.example:443", True),
    ("http://pool.example:8080", "pool.example", False),  # port 80 asked
    ("http://127.0.0.1:3000", "127.0.0.1:8080", False),
    ("http://rebind.example:8080", "127.0.0.1:8080", False),
    ("null", "127.0.0.1:8080", False),
    ("http://[::1]:8080", "[::1]:8080", True),
    ("http://127.0.0.1:8080", None, False),
])
def test_same_origin(origin, host, same):
    assert same_origin(origin, host) is same


# --- the settings, and what up forwards -----------------------------------------------


def test_cors_is_granted_by_default_only_with_keys():
    assert FrontendSettings.from_env(BASE).web_origins() == ()
    keyed = FrontendSettings.from_env({**BASE, "LLAMAPOOL_API_KEYS": "k"})
    assert keyed.web_origins() == ("*",)
    given = {**BASE, "LLAMAPOOL_CORS_ORIGINS": "http://a.example,http://b.example"}
    assert FrontendSettings.from_env(given).web_origins() == (
        "http://a.example", "http://b.example")
    with pytest.raises(ConfigError, match="LLAMAPOOL_CORS_ORIGINS"):
        FrontendSettings.from_env({**BASE, "LLAMAPOOL_CORS_ORIGINS": "*,http://a"})
    with pytest.raises(ConfigError, match="LLAMAPOOL_ALLOWED_HOSTS"):
        FrontendSettings.from_env({**BASE, "LLAMAPOOL_ALLOWED_HOSTS": "*,a"})


def test_up_forwards_allowed_hosts_and_cors_origins():
    args = build_parser().parse_args(["up", "--allowed-hosts", "a.example,b.example",
                                      "--cors-origins", "http://c.example"])
    argv = as_argv(FrontendSettings,
                   given_flags(args, FrontendSettings, UP_FRONTEND_FLAGS))
    frontend = build_parser().parse_args(["frontend", "--broker", "ipc:///x", *argv])
    assert frontend.allowed_hosts == ("a.example", "b.example")
    assert frontend.cors_origins == ("http://c.example",)
    assert "--allowed-hosts" not in as_argv(FrontendSettings, given_flags(
        build_parser().parse_args(["up"]), FrontendSettings, UP_FRONTEND_FLAGS))


# --- the app's answers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def keyless(inproc_pool):
    return inproc_pool.client()


@pytest.fixture(scope="module")
def keyed(inproc_pool):
    return inproc_pool.client(api_keys=("sk-29",))


@pytest.fixture(scope="module")
def listed(inproc_pool):
    return inproc_pool.client(cors_origins=("http://page.example",),
                              allowed_hosts=("pool.example",))


def test_a_keyless_pool_grants_no_origin(keyless):
    r = keyless.simulate_get("/slots")
    assert r.status_code == 200
    assert "Access-Control-Allow-Origin" not in r.headers
    r = keyless.simulate_options("/v1/chat/completions", headers={
        "Origin": "http://page.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403
    assert "Access-Control-Allow-Origin" not in r.headers


def test_a_keyed_pool_grants_any_origin_as_llama_cpp(keyed):
    r = keyed.simulate_get("/v1/models", headers={"Origin": "http://page.example"})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "*"


def test_a_listed_origin_and_host(listed, inproc_pool):
    ok = listed.simulate_get("/slots", headers={"Origin": "http://page.example",
                                                "Host": "pool.example"})
    assert ok.status_code == 200
    assert ok.headers["Access-Control-Allow-Origin"] == "http://page.example"
    before = inproc_pool.submitted()
    r = listed.simulate_post("/v1/completions", json={"prompt": "a"}, headers={
        "Origin": "http://other.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json["error"]["code"] == "origin_not_allowed"
    r = listed.simulate_get("/slots", headers={"Host": "rebind.example"})
    assert r.status_code == 421 and r.json["error"]["code"] == "misdirected_request"
    assert inproc_pool.submitted() == before


# --- JSON depth (item 6) --------------------------------------------------------------


def test_json_depth_counts_outside_strings_without_recursion():
    assert json_depth('{"a": "[[[{{", "b": [1, {"c": "\\"]["}]}') == 3
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000
    assert json_depth('[["unterminated') == 2
    # An unterminated string then escaped quotes: linear, not quadratic.
    assert json_depth('"' + '\\"' * 200_000) == 0


def test_loads_shallow():
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_shallow(nested)
    with pytest.raises(TooDeep):
        loads_shallow("[" + nested + "]")


def test_deep_calls_are_text_in_output_and_a_400_in_history():
    deep = "[" * 1100 + "]" * 1100
    block = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert split_calls(block) == (block, [])
    with pytest.raises(BadRequest) as raised:
        history_calls([{"function": {"name": "f", "arguments": deep}}],
                      "messages[1].tool_calls")
    assert raised.value.param == "messages[1].tool_calls[0].function.arguments"
    shallow = json.dumps({"a": [[1]]})
    assert "".join(HERMES.write(c.name, c.arguments) for c in history_calls(
        [{"function": {"name": "f", "arguments": shallow}}], "m")) == (
            '<tool_call>{"name": "f", "arguments": {"a": [[1]]}}</tool_call>')
